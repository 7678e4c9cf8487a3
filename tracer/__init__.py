"""tracer: a layer-by-layer divergence tracer for Llama-family language models.

    >>> import tracer
    >>> result = tracer.run(variant="theta=10000", progress=False)  # hf vs reimpl, bundled SmolLM2
    >>> result.first_divergence.point
    'model.layers.0.self_attn.q_rope'

`record` (model, tokens -> Trace), `compare` (Trace, Trace -> Result), `run` (both, plus
greedy continuations and the report folder), `sweep` (many variants against one reference),
`diagnose` (which known mistake a foreign trace looks like), `compare_files` (two saved
traces, any runtime's names), `audit_gguf` (a GGUF's tensors against the model's own) and
`quality` (llama-perplexity's KL-divergence figures over a text, and where the loss is made) are
the API; the CLI maps onto them. Names load on first use, so `import tracer` (and `tracer
variants`) does not pay for torch.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "record": "tracer.api", "run": "tracer.api", "sweep": "tracer.api", "diagnose": "tracer.api",
    "compare_files": "tracer.api", "audit_gguf": "tracer.api", "quality": "tracer.api", "compare": "tracer.diff",
    "Quality": "tracer.corpus",
    "Result": "tracer.result", "PointDiff": "tracer.result", "Tolerance": "tracer.result",
    "Sweep": "tracer.result", "SweepRow": "tracer.result", "Diagnosis": "tracer.result",
    "Divergence": "tracer.result", "LogitsSummary": "tracer.result", "Greedy": "tracer.result",
    "RegimeView": "tracer.result", "WeightAudit": "tracer.result",
    "Trace": "tracer.trace", "TraceMeta": "tracer.trace", "TracerError": "tracer.errors",
    "default_model_path": "tracer.sources",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tracer' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_EXPORTS])
