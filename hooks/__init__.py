"""tracer.hooks: the `hf` engine, transformers observed through forward hooks and a registered
attention function. Every hook and registration is removed on exit, even when the forward raises.
"""

from tracer.hooks.attention import recording_attention
from tracer.hooks.engine import HFEngine
from tracer.hooks.modules import recording_modules

__all__ = ["HFEngine", "recording_attention", "recording_modules"]
