"""Comparing traces: the per-point diff and its result values, explanations, decode steps and batch rows,
fingerprints and llama-perplexity's figures. Above the engines; it reads traces (`tracer.traces`)."""
