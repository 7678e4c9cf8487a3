"""tracer.hooks: the `hf` engine, transformers observed through forward hooks and a registered
attention function. Every hook and registration is removed on exit, even when the forward raises.
"""

from .attention import recording_attention
from .engine import HFEngine
from .modules import recording_modules

__all__ = ["HFEngine", "recording_attention", "recording_modules"]
