"""Engines: what turns token ids into a `Trace`.

- `registry`: every engine as data (what it records, which knobs it honours, whether it can
  run teacher-forced local errors or draft greedy continuations, which devices and runtime it
  needs). Pure Python: `tracer variants` and `tracer engines` read it without torch.
- `base`: the `Engine` protocol and `EngineBase`, what every engine class inherits (metadata,
  positions).
- `load`: `resolve_target(model, engines, ...)`, where a command's engines load (the device, offloading,
  the model source, its family), resolved and checked once; `load_engine(engine, variant, target)`, the
  one way an engine is built from its registry entry on that target.
- one module per engine: `hf`, `reimpl`, `file`, `candle`, `llamacpp`, `mlx`, `onnx`.

Adding an engine is one module: a class on `EngineBase`, a `load(source, variant, *, argument,
device, stream)` function and its `EngineEntry` registered (`registry.register`); another package's
module is found through the entry-point group `tracer.engines` (docs/engines.md).
"""
