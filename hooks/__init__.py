"""tracer.hooks: the `hf` engine, transformers observed through forward hooks and a registered
attention function. Every hook and registration is removed on exit, even when the forward raises.
"""

import importlib

__all__ = ["HFEngine", "recording_attention", "recording_modules"]
_HOMES = {"HFEngine": "tracer.engines.hf", "recording_attention": "tracer.hooks.attention",
          "recording_modules": "tracer.hooks.modules"}


def __getattr__(name: str):
    # Lazy: loading the hf engine checks the model's files before transformers is imported.
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'tracer.hooks' has no attribute {name!r}")
