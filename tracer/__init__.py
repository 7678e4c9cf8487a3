"""tracer: a layer-by-layer divergence tracer for Llama-family language models.

    >>> import tracer
    >>> result = tracer.run(variant="theta=10000")       # hf vs reimpl on the bundled SmolLM2
    >>> result.first_divergence["point"]
    'model.layers.0.self_attn.q_rope'

`record` (model, tokens -> Trace), `compare` (Trace, Trace -> Result) and `run` (both, plus
greedy continuations and the report folder) are the API; the CLI maps onto them.
"""

__version__ = "0.1.0"

from tracer.api import record, run
from tracer.diff import PointDiff, Result, Tolerance, compare
from tracer.errors import TracerError
from tracer.trace import Trace


def default_model_path(cache_dir=None, progress: bool = True):
    """The bundled SmolLM2-135M-Instruct as a cached HF directory, converted on first use."""
    from tracer.model import default_model_path as _default_model_path

    return _default_model_path(cache_dir, progress=progress)


__all__ = [
    "PointDiff", "Result", "Tolerance", "Trace", "TracerError",
    "compare", "default_model_path", "record", "run",
]
