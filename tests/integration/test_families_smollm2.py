"""The bundled SmolLM2 after the families came in: still a Llama, traced bitwise alike by both
engines, and its sweep is the one it always was (no family knob of another family in it)."""

import torch

import tracer
from tracer.model.config import load_config, read_hf
from tracer.model.points import all_points
from tracer.pipeline.catalogue import default_variants

PROMPT = "The capital of France is"
SMOLLM2_SWEEP = ["theta=10000", "eps=1e-3", "attn=sdpa", "dtype=bf16", "rope=interleaved", "rope_scaling=drop",
                 "kv_repeat=tile", "mask=none", "attn_math=candle", "norm=candle", "bias=ignore", "logits=last",
                 "config=candle", "config=candle,resave=tf5", "preset=candle", "layers=31", "head_dim=32"]


def test_smollm2_is_bitwise_identical_on_both_engines(default_model):
    reference = tracer.record(default_model, PROMPT, engine="hf")
    candidate = tracer.record(default_model, PROMPT, engine="reimpl")
    assert reference.meta.family == candidate.meta.family == "llama"
    assert reference.points == candidate.points == all_points(30)
    assert all(torch.equal(reference[p], candidate[p]) for p in reference.points)


def test_smollm2_sweep_is_unchanged(default_model):
    assert default_variants(read_hf(load_config(default_model))) == SMOLLM2_SWEEP
