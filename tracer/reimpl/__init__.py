"""tracer's own forward, driven block by block: the model (`forward`, its cache `tracer.model.kv_cache.KVCache`),
the forced runs on a reference's inputs (`forced_runs`) and the runs stepped one unit at a time (`unit_runs`)."""
