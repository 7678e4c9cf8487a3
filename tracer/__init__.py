"""tracer: a layer-by-layer divergence tracer for Llama-family language models.

    >>> import tracer
    >>> result = tracer.run(variant="theta=10000")       # hf vs reimpl on the bundled SmolLM2
    >>> result.first_divergence["point"]
    'model.layers.0.self_attn.q_rope'

`record` (model, tokens -> Trace), `compare` (Trace, Trace -> Result) and `run` (both, plus
greedy continuations and the report folder) are the API; the CLI maps onto them. Names load on
first use, so `import tracer` (and `tracer variants`) does not pay for torch.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "record": "tracer.api", "run": "tracer.api", "compare_files": "tracer.api",
    "compare": "tracer.diff", "Result": "tracer.diff", "PointDiff": "tracer.diff", "Tolerance": "tracer.diff",
    "Trace": "tracer.trace", "TracerError": "tracer.errors", "default_model_path": "tracer.model",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tracer' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_EXPORTS])
