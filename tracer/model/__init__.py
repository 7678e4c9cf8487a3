"""What a model is, as declared parts: the point vocabulary (`points`), the base types (`component`),
one module per part (`components/`), the families as compositions of them (`families`; the mixtures
of experts in `moe_families`, gpt-oss in `gpt_oss_family`, DeepSeek-V3 in `deepseek_family`), the knobs
(`knobs`) and the config readers (`config`); other runtimes' names and switches are theirs
(`tracer.names`, `tracer.engines.registry`). Importing it never loads torch. Importing any of it
registers the built-in families first."""

# Registration order is the families' order (`tracer variants`, the engine × family matrix, execution order
# of a sub-point Llama lacks): the dense ones, then the mixtures of experts; so not sorted. DeepSeek-V3 last,
# so that the families before it keep their records of the points they share with it.
from tracer.model import families  # noqa: F401, I001  (registers the built-in families)
from tracer.model import moe_families  # noqa: F401  (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, derived from Llama)
from tracer.model import gpt_oss_family  # noqa: F401  (gpt-oss, derived from Llama)
from tracer.model import deepseek_family  # noqa: F401  (DeepSeek-V3: latent attention, its router)
