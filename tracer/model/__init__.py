"""What a model is, as declared parts: the point vocabulary (`points`), the base types (`component`),
one module per part (`components/`), the families as compositions of them (`families`; the mixtures
of experts in `moe_families`, DeepSeek-V3 in `deepseek_family`), the knobs
(`knobs`) and the config readers (`config`); other runtimes' names and switches are theirs
(`tracer.names`, `tracer.engines.registry`). Importing it never loads torch. Importing any of it
registers the built-in families first."""

from tracer.model import (  # noqa: I001  (registration order: see the last import)
    families,  # noqa: F401  (registers the built-in families)
    moe_families,  # noqa: F401  (then the mixtures of experts, derived from Llama)
)
# last, so that the families before it keep their records of the points they share with it
from tracer.model import deepseek_family  # noqa: F401  (DeepSeek-V3: latent attention, its router)
