"""How far the routing diff's near-tie rule sits from the noise and from a fault (docs/moe.md, "The near-tie
rule"), measured on tiny random Mixtrals.

    python bench/routing_noise.py                      # 2048 tokens, seeds 0 1 2
    python bench/routing_noise.py --tokens 512 --seeds 0

Each seed writes no file: a random `MixtralForCausalLM` (hidden 64, 2 layers, 8 experts, top-2) runs the
same random tokens in f32 (the reference), in f16 and in bf16 (correct ports whose flips are noise), and in
f32 with two experts' router rows swapped in the last layer (a fault). The routing points are read off
transformers' modules by forward hooks (the router's input, its logits, and the softmax, top-k and
renormalized weights computed from them as `MixtralTopKRouter` computes them), and `routing_diff` compares
each candidate with the reference. Printed per case: the flips, how many the rule calls near-ties and
structural, and each kind's ratio of overturned margin to the error reaching the router (the rule calls a
flip a near-tie up to `NEAR_TIE_FACTOR`): the largest of the noise's, the smallest of the fault's.
"""

from __future__ import annotations

import argparse
import copy
from contextlib import contextmanager

import torch

from tracer import Trace, TraceMeta
from tracer.comparison.routing import NEAR_TIE_FACTOR, routing_diff
from tracer.model.points import (
    POST_ATTENTION_NORM,
    ROUTER_LOGITS,
    ROUTER_SCORES,
    TOP_K_INDEX,
    TOP_K_WEIGHTS,
    layer_point,
)

TOP_K = 2


def tiny_mixtral(seed: int):
    from transformers import MixtralConfig, MixtralForCausalLM  # transformers: only this script needs it

    torch.manual_seed(seed)
    config = MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=TOP_K,
                           vocab_size=1000, max_position_embeddings=4096)
    return MixtralForCausalLM(config).eval()


@contextmanager
def routing_hooks(model, points: dict):
    """Record each layer's router input and routing points into `points` while inside; every hook removed."""
    handles = []

    def router(i):
        def hook(module, args, out):
            logits = out[0].float()  # (T, E): MixtralTopKRouter returns (logits, top-k weights, top-k ids)
            scores = torch.softmax(logits, dim=-1)  # (T, E)
            top, index = torch.topk(scores, TOP_K, dim=-1)  # (T, k) each
            points.update({layer_point(i, ROUTER_LOGITS): logits, layer_point(i, ROUTER_SCORES): scores,
                           layer_point(i, TOP_K_INDEX): index,
                           layer_point(i, TOP_K_WEIGHTS): top / top.sum(-1, keepdim=True)})
        return hook

    def norm(i):
        def hook(module, args, out):
            points[layer_point(i, POST_ATTENTION_NORM)] = out[0].float()  # (T, C)
        return hook

    try:
        for i, layer in enumerate(model.model.layers):
            handles.append(layer.post_attention_layernorm.register_forward_hook(norm(i)))
            handles.append(layer.mlp.gate.register_forward_hook(router(i)))
        yield points
    finally:
        for handle in handles:
            handle.remove()


def traced(model, tokens: torch.Tensor, dtype: torch.dtype) -> Trace:
    model = copy.deepcopy(model).to(dtype)
    with routing_hooks(model, {}) as points, torch.no_grad():
        model(tokens[None])
    return Trace(points, TraceMeta(engine="hf", variant={}, tokens=tokens.tolist()))


def swapped_router(model):
    """The model with experts 0 and 1 of the last layer's router swapped: a fault the routing must show."""
    model = copy.deepcopy(model)
    weight = model.model.layers[-1].mlp.gate.weight.data  # (E, C)
    weight[[0, 1]] = weight[[1, 0]]
    return model


def row(case: str, diff) -> str:
    noise = [f.margin / f.error for f in diff.flips if f.kind == "near_tie"]
    fault = [f.margin / f.error for f in diff.flips if f.kind == "structural"]
    counts = diff.counts()
    largest, smallest = f"{max(noise):.3g}" if noise else "—", f"{min(fault):.3g}" if fault else "—"
    return f"| {case} | {counts['flips']} | {counts['near_ties']} | {counts['structural']} | {largest} | {smallest} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    print(f"near-tie factor {NEAR_TIE_FACTOR:g}; {args.tokens} tokens, 2 layers, 8 experts, top-{TOP_K}\n")
    print("| case | flips | near-ties | structural | largest near-tie margin/error | smallest structural |")
    print("|---|--:|--:|--:|--:|--:|")
    for seed in args.seeds:
        model = tiny_mixtral(seed)
        generator = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, model.config.vocab_size, (args.tokens,), generator=generator)
        reference = traced(model, tokens, torch.float32)
        for name, candidate in (("f16", traced(model, tokens, torch.float16)),
                                ("bf16", traced(model, tokens, torch.bfloat16)),
                                ("router rows swapped", traced(swapped_router(model), tokens, torch.float32))):
            print(row(f"seed {seed}, {name}", routing_diff(reference, candidate)))


if __name__ == "__main__":
    main()
