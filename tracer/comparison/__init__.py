"""Traces as data and comparing them: the trace, the per-point diff and its result, explanations."""
