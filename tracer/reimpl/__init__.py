"""tracer's own forward, driven block by block: the model (`forward`), its KV cache (`kv_cache`) and the
forced runs on a reference's inputs (`forced_runs`)."""
