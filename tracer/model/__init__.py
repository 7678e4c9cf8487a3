"""What a model is, as declared parts: the point vocabulary (`points`), the base types (`component`),
one module per part (`components/`), the families as compositions of them (`families`; the mixtures
of experts in `moe_families`, gpt-oss in `gpt_oss_family`), the knobs
(`knobs`) and the config readers (`config`); other runtimes' names and switches are theirs
(`tracer.names`, `tracer.engines.registry`). Importing it never loads torch. Importing any of it
registers the built-in families first."""

from tracer.model import (
    families,  # noqa: F401  (registers the built-in families)
    gpt_oss_family,  # noqa: F401  (gpt-oss, derived from Llama)
    moe_families,  # noqa: F401  (the other mixtures of experts, derived from Llama)
)
