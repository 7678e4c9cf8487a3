"""Traces as data: a `Trace` (point name -> tensor, with its metadata and decode steps), its safetensors
file, spilling to disk point by point, other runtimes' layouts brought to ours, and foreign dumps
(tensor-parallel shards, SGLang's dumper). Below the engines, which record into it; the comparison
reads it and never the other way round."""
