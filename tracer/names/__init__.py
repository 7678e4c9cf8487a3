"""Other runtimes' names for tracer's points: one vocabulary per runtime or dump format, and the alias
table gathered from them.

- `vocabulary`: the types (`Vocabulary`, `Name`) and the registry every vocabulary registers into.
- one module per runtime or dump format: `hf` (transformers' module paths that are not points), `candle`
  (candle-transformers' llama.rs), `llamacpp` (llama.cpp's graph names), `gguf` (GGUF tensor names, from
  gguf-py's `TensorNameMap`), `transformer_lens` (TransformerLens 3 and 4 hooks), `mlx` (mlx-lm's module
  calls).
- `aliases`: the built-in vocabularies registered, and every registered one gathered into the table a
  foreign dump's names are mapped with (`AliasTable`, `rename`).

Nothing here imports a runtime: a dump's names are read without llama.cpp, candle, mlx or TransformerLens.
"""
