"""Engines: what turns token ids into a `Trace`.

- `registry`: every engine as data (what it records, which knobs it honours, whether it can
  run teacher-forced local errors or draft greedy continuations, which devices and runtime it
  needs). Pure Python: `tracer variants` and `tracer engines` read it without torch.
- `base`: the `Engine` protocol and what every engine shares (metadata, device checks).
- `load`: `load_engine(name, ...)`, the one way an engine is built from its registry entry.
- one module per engine: `reimpl`, `file`, and `tracer.engines.hf` for `hf`.

Adding an engine is one module with a `load(source, variant, *, argument, device, stream)`
function and one `EngineEntry` in `registry.ENGINES` (docs/engines.md).
"""
