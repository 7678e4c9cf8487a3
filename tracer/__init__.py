"""tracer: a layer-by-layer divergence tracer for Llama-family language models.

    >>> import tracer
    >>> result = tracer.run(variant="theta=10000", progress=False)  # hf vs reimpl, bundled SmolLM2
    >>> result.first_divergence.point
    'model.layers.0.self_attn.q_rope'

`record` (model, tokens -> Trace), `compare` (Trace, Trace -> Result), `run` (both, plus greedy
continuations and the report folder; several candidates on one reference run: a `Triangulation`),
`sweep` (many variants against one reference), `diagnose` (which known mistake a foreign trace
looks like), `compare_files` (two saved traces, any runtime's names), `audit_gguf` (a GGUF's
tensors against the model's own) and `quality` (llama-perplexity's KL-divergence figures over a
text, and where the loss is made) are the API; the CLI maps onto them. Names load on first use, so
`import tracer` (and `tracer variants`) does not pay for torch.
"""

import importlib

import tracer.engines.registry  # noqa: F401  (registers the built-in engines, their runtimes' switches among the knobs)
import tracer.reports  # noqa: F401  (registers the renderers Result, Trace and Sweep look up)
from tracer.core import __version__  # noqa: F401  (tracer.__version__)

_API, _RESULT, _TRACE = "tracer.api", "tracer.comparison.result", "tracer.traces.trace"
_EXPORTS = {
    "record": _API, "run": _API, "sweep": _API, "diagnose": _API, "compare_files": _API, "audit_gguf": _API,
    "quality": _API, "compare": "tracer.comparison.diff", "Quality": "tracer.pipeline.corpus",
    "Result": _RESULT, "PointDiff": _RESULT, "Tolerance": _RESULT, "Sweep": _RESULT, "SweepRow": _RESULT,
    "Diagnosis": _RESULT, "Divergence": _RESULT, "LogitsSummary": _RESULT, "Greedy": _RESULT,
    "RegimeView": _RESULT, "Triangulation": _RESULT, "AgreementRow": _RESULT, "WeightAudit": "tracer.ggml.audit",
    "Trace": _TRACE, "TraceMeta": _TRACE, "TracerError": "tracer.core.errors",
    "default_model_path": "tracer.files.sources",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tracer' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_EXPORTS])
