"""Build other runtimes' dumps from a recorded trace, the way those runtimes lay them out.

The names come from each runtime's own code (candle's llama.rs fields, llama.cpp's graph names),
written here by hand rather than derived from tracer's alias table, so a wrong alias fails the
tests instead of agreeing with itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tracer.model.points import layer_of
from tracer.traces.layouts import to_interleaved

# our point (layer part as {i}) -> candle llama.rs field path
CANDLE_NAMES = {
    "model.embed_tokens": "wte",
    "model.layers.{i}.input_layernorm": "blocks.{i}.rms_1",
    "model.layers.{i}.self_attn.q_proj": "blocks.{i}.attn.q_proj",
    "model.layers.{i}.self_attn.k_proj": "blocks.{i}.attn.k_proj",
    "model.layers.{i}.self_attn.v_proj": "blocks.{i}.attn.v_proj",
    "model.layers.{i}.self_attn.o_proj": "blocks.{i}.attn.o_proj",
    "model.layers.{i}.post_attention_layernorm": "blocks.{i}.rms_2",
    "model.layers.{i}.mlp.gate_proj": "blocks.{i}.mlp.c_fc1",
    "model.layers.{i}.mlp.up_proj": "blocks.{i}.mlp.c_fc2",
    "model.layers.{i}.mlp.down_proj": "blocks.{i}.mlp.c_proj",
    "model.layers.{i}": "blocks.{i}",
    "model.norm": "ln_f",
    "lm_head": "lm_head",
}

# our point -> llama.cpp's eval-callback name ("name-il")
GGML_NAMES = {
    "model.embed_tokens": "inp_embd",
    "model.layers.{i}.input_layernorm": "attn_norm-{i}",
    "model.layers.{i}.self_attn.q_rope": "Qcur-{i}",
    "model.layers.{i}.self_attn.k_rope": "Kcur-{i}",
    "model.layers.{i}.self_attn.v_proj": "Vcur-{i}",
    "model.layers.{i}.self_attn.probs": "kq_soft_max-{i}",
    "model.layers.{i}.self_attn.context": "kqv_out-{i}",
    "model.layers.{i}.self_attn.o_proj": "attn_out-{i}",
    "model.layers.{i}.resid_mid": "ffn_inp-{i}",
    "model.layers.{i}.post_attention_layernorm": "ffn_norm-{i}",
    "model.layers.{i}.mlp.gate_proj": "ffn_gate-{i}",
    "model.layers.{i}.mlp.up_proj": "ffn_up-{i}",
    "model.layers.{i}.mlp.act": "ffn_swiglu-{i}",
    "model.layers.{i}.mlp.down_proj": "ffn_out-{i}",
    "model.layers.{i}": "l_out-{i}",
    "model.norm": "result_norm",
    "lm_head": "result_output",
}


def their_name(point: str, names: dict[str, str]) -> str | None:
    layer = layer_of(point)
    pattern = point if layer is None else point.replace(f"model.layers.{layer}", "model.layers.{i}", 1)
    name = names.get(pattern)
    return None if name is None else name.replace("{i}", str(layer))


def candle_dump(trace) -> dict[str, torch.Tensor]:
    """candle llama.rs: field names, a batch dimension of 1, logits of the last position only ((1, V))."""
    dump = {}
    for point, tensor in trace.tensors.items():
        name = their_name(point, CANDLE_NAMES)
        if name is not None:
            dump[name] = (tensor[-1:] if point == "lm_head" else tensor[None]).contiguous()
    return dump


def ggml_dump(trace, points=None) -> dict[str, torch.Tensor]:
    """llama.cpp: graph names; Qcur/Kcur after RoPE as (T, H, D) in GGUF's interleaved order,
    Vcur as (T, KV, D), kq_soft_max over a KV cache padded by 3 keys; from ffn_inp of the last layer on,
    only the last row (llama.cpp's inp_out_ids); row-major order of ggml's ne (reversed)."""
    last_layer = trace.meta.num_layers - 1
    dump = {}
    for point, tensor in trace.tensors.items():
        name = their_name(point, GGML_NAMES)
        if name is None or (points is not None and point not in points):
            continue
        sub = point.removeprefix(f"model.layers.{layer_of(point)}.")
        if sub in ("self_attn.q_rope", "self_attn.k_rope"):
            heads, tokens, dim = tensor.shape
            tensor = to_interleaved(tensor.transpose(0, 1).reshape(tokens, heads * dim), dim)  # (T, H*D) GGUF order
            tensor = tensor.reshape(tokens, heads, dim)  # (T, H, D)
        elif sub == "self_attn.probs":  # (H, T, n_kv): the KV cache is padded, its extra keys masked to 0
            tensor = torch.cat((tensor, tensor.new_zeros(*tensor.shape[:2], 3)), dim=-1)
        elif sub == "self_attn.v_proj":
            tensor = tensor.reshape(tensor.shape[0], -1,
                                    trace["model.layers.0.self_attn.k_rope"].shape[-1])  # (T, KV, D)
        if layer_of(point) == last_layer and sub in ("resid_mid", "post_attention_layernorm", "mlp.gate_proj",
                                                       "mlp.up_proj", "mlp.act", "mlp.down_proj"):
            tensor = tensor[-1:]
        if point in ("model.norm", "lm_head", f"model.layers.{last_layer}"):
            tensor = tensor[-1:]
        dump[name] = tensor.contiguous()
    return dump


def save_dump(dump: dict, path: Path, tokens=None, **metadata) -> Path:
    meta = {key: str(value) for key, value in metadata.items()}
    if tokens is not None:
        meta["tokens"] = json.dumps(list(tokens))
    save_file(dump, str(path), metadata=meta)
    return path


def faulty_trace(model_dir: Path, tokens, layer: int, scale: float = 0.01):
    """The reimpl engine with one layer's mlp.down_proj weight perturbed by `scale`·N(0, 1) relative
    noise: a fault at that op whose effect propagates downstream like a real one."""
    from tracer.engines.reimpl import ReimplEngine
    from tracer.files.weights import read_weights
    from tracer.model.config import load_config, read_hf
    from tracer.reimpl.forward import Model

    weights = read_weights(model_dir)
    name = f"model.layers.{layer}.mlp.down_proj.weight"
    noise = torch.randn(weights[name].shape, generator=torch.Generator().manual_seed(0))
    weights[name] = weights[name] * (1 + scale * noise)
    llama = Model(read_hf(load_config(model_dir)), weights)
    return ReimplEngine(llama, str(model_dir)).record(list(tokens))


# TransformerLens 4.3's TransformerBridge.run_with_cache on a Llama (SmolLM2), every name in the cache's
# own order, copied from a real run: (name, our point or None for a name with no point). Several names
# hold one tensor (hook_q is attn.q.hook_out, hook_z attn.o.hook_in, hook_resid_mid ln2.hook_in).
TRANSFORMER_LENS_4_BEFORE = [
    ("embed.hook_in", None),  # the token ids
    ("embed.hook_out", "model.embed_tokens"),
    ("hook_embed", "model.embed_tokens"),
    ("rotary_emb.hook_in", None),
    ("rotary_emb.hook_cos", None),
    ("rotary_emb.hook_sin", None),
]
TRANSFORMER_LENS_4_BLOCK = [
    ("blocks.{i}.hook_in", None),
    ("blocks.{i}.hook_resid_pre", None),
    ("blocks.{i}.ln1.hook_in", None),
    ("blocks.{i}.ln1.hook_scale", None),
    ("blocks.{i}.ln1.hook_normalized", None),
    ("blocks.{i}.ln1.hook_out", "model.layers.{i}.input_layernorm"),
    ("blocks.{i}.attn.hook_in", None),
    ("blocks.{i}.attn.q.hook_in", None),
    ("blocks.{i}.attn.q.hook_out", "model.layers.{i}.self_attn.q_proj"),
    ("blocks.{i}.attn.hook_q", "model.layers.{i}.self_attn.q_proj"),
    ("blocks.{i}.attn.k.hook_in", None),
    ("blocks.{i}.attn.k.hook_out", "model.layers.{i}.self_attn.k_proj"),
    ("blocks.{i}.attn.hook_k", "model.layers.{i}.self_attn.k_proj"),
    ("blocks.{i}.attn.v.hook_in", None),
    ("blocks.{i}.attn.v.hook_out", "model.layers.{i}.self_attn.v_proj"),
    ("blocks.{i}.attn.hook_v", "model.layers.{i}.self_attn.v_proj"),
    ("blocks.{i}.attn.hook_cos", None),
    ("blocks.{i}.attn.hook_sin", None),
    ("blocks.{i}.attn.hook_rot_q", "model.layers.{i}.self_attn.q_rope"),
    ("blocks.{i}.attn.hook_rot_k", "model.layers.{i}.self_attn.k_rope"),
    ("blocks.{i}.attn.hook_attn_scores", "model.layers.{i}.self_attn.scores"),
    ("blocks.{i}.attn.hook_pattern", "model.layers.{i}.self_attn.probs"),
    ("blocks.{i}.attn.o.hook_in", "model.layers.{i}.self_attn.context"),
    ("blocks.{i}.attn.hook_z", "model.layers.{i}.self_attn.context"),
    ("blocks.{i}.attn.o.hook_out", "model.layers.{i}.self_attn.o_proj"),
    ("blocks.{i}.attn.hook_out", "model.layers.{i}.self_attn.o_proj"),
    ("blocks.{i}.hook_attn_out", "model.layers.{i}.self_attn.o_proj"),
    ("blocks.{i}.ln2.hook_in", "model.layers.{i}.resid_mid"),
    ("blocks.{i}.hook_resid_mid", "model.layers.{i}.resid_mid"),
    ("blocks.{i}.ln2.hook_scale", None),
    ("blocks.{i}.ln2.hook_normalized", None),
    ("blocks.{i}.ln2.hook_out", "model.layers.{i}.post_attention_layernorm"),
    ("blocks.{i}.mlp.hook_in", None),
    ("blocks.{i}.mlp.gate.hook_in", None),
    ("blocks.{i}.mlp.gate.hook_out", "model.layers.{i}.mlp.gate_proj"),
    ("blocks.{i}.mlp.hook_pre", "model.layers.{i}.mlp.gate_proj"),
    ("blocks.{i}.mlp.in.hook_in", None),
    ("blocks.{i}.mlp.in.hook_out", "model.layers.{i}.mlp.up_proj"),
    ("blocks.{i}.mlp.hook_pre_linear", "model.layers.{i}.mlp.up_proj"),
    ("blocks.{i}.mlp.out.hook_in", "model.layers.{i}.mlp.act"),
    ("blocks.{i}.mlp.hook_post", "model.layers.{i}.mlp.act"),
    ("blocks.{i}.mlp.out.hook_out", "model.layers.{i}.mlp.down_proj"),
    ("blocks.{i}.mlp.hook_out", "model.layers.{i}.mlp.down_proj"),
    ("blocks.{i}.hook_mlp_out", "model.layers.{i}.mlp.down_proj"),
    ("blocks.{i}.hook_out", "model.layers.{i}"),
    ("blocks.{i}.hook_resid_post", "model.layers.{i}"),
]
TRANSFORMER_LENS_4_AFTER = [
    ("ln_final.hook_in", None),
    ("ln_final.hook_scale", None),
    ("ln_final.hook_normalized", None),
    ("ln_final.hook_out", "model.norm"),
    ("unembed.hook_in", None),
    ("unembed.hook_out", "lm_head"),
    ("hook_unembed", "lm_head"),
]


def transformer_lens_4_names(num_layers: int) -> list[tuple[str, str | None]]:
    """Every (name, point) of a TransformerLens 4.3 bridge cache on a Llama of `num_layers` layers, in order."""
    block = [(name.replace("{i}", str(i)), point and point.replace("{i}", str(i)))
             for i in range(num_layers) for name, point in TRANSFORMER_LENS_4_BLOCK]
    return [*TRANSFORMER_LENS_4_BEFORE, *block, *TRANSFORMER_LENS_4_AFTER]


def _transformer_lens_layout(point: str, tensor: torch.Tensor, head_dim: int) -> torch.Tensor:
    """A point of ours in TransformerLens' layout: a batch dimension of 1, per-head tensors as
    [batch, pos, head, d_head], attention as [batch, head, query, key]."""
    sub = point.rsplit(".", 1)[-1] if point.startswith("model.layers.") else point
    if sub in ("q_rope", "k_rope"):  # (H, T, D) -> (T, H, D)
        tensor = tensor.transpose(0, 1)
    elif sub in ("q_proj", "k_proj", "v_proj", "context"):  # (T, H*D) -> (T, H, D)
        tensor = tensor.reshape(tensor.shape[0], -1, head_dim)
    return tensor[None].clone(memory_format=torch.contiguous_format)  # its own storage, like the writer's clone


def transformer_lens_4_dump(trace) -> dict[str, torch.Tensor]:
    """A TransformerLens 4 bridge cache as the docs' writer saves it: every name of the real cache,
    the points' values in TransformerLens' layout, the names without a point filled with stand-ins of
    their shapes (token ids, rotary tables, RMS scales, x / rms, module inputs)."""
    head_dim = trace["model.layers.0.self_attn.q_rope"].shape[-1]
    tokens = len(trace.tokens)
    hidden = trace["model.embed_tokens"].shape[-1]
    stand_ins = {"hook_scale": (1, tokens, 1), "hook_cos": (1, tokens, head_dim), "hook_sin": (1, tokens, head_dim)}
    dump = {"embed.hook_in": torch.tensor([trace.tokens])}
    for name, point in transformer_lens_4_names(trace.meta.num_layers)[1:]:
        if point is not None:
            dump[name] = _transformer_lens_layout(point, trace[point], head_dim)
        else:
            shape = next((shape for key, shape in stand_ins.items() if name.endswith(key)), (1, tokens, hidden))
            dump[name] = torch.full(shape, 0.5)
    return dump


# SGLang's Llama (sglang/srt/models/llama.py) under its dumper's non-intrusive hooks: one layer's
# modules in forward order as (module, inputs, outputs), what each forward takes and returns on one
# rank (`part` cuts that rank's slice), and the two explicit dumps a user adds with `dims`
# ("explicit", name, tensor, dims, layer). Written from SGLang's code, not from tracer's tables.
def _sglang_layer_modules(trace, i: int, part):
    p = f"model.layers.{i}."

    def heads(point):
        return part(trace[p + point], 0).transpose(0, 1).flatten(1)  # (H/N, T, D) -> (T, H/N·D)

    residual_in = trace["model.embed_tokens"] if i == 0 else trace[f"model.layers.{i - 1}"]
    norm_in = trace["model.embed_tokens"] if i == 0 else trace[f"model.layers.{i - 1}.mlp.down_proj"]
    qkv = torch.cat([part(trace[p + f"self_attn.{x}_proj"], -1) for x in "qkv"], dim=-1)  # [q_r, k_r, v_r]
    gate_up = torch.cat([part(trace[p + f"mlp.{x}_proj"], -1) for x in ("gate", "up")], dim=-1)  # [gate_r, up_r]
    # layer 0's input norm has no residual yet and hands out one tensor; later ones (normed, residual)
    input_norm = ((trace[p + "input_layernorm"],) if i == 0 else (trace[p + "input_layernorm"], residual_in))
    return [
        (p + "input_layernorm", (norm_in,) if i == 0 else (norm_in, residual_in), input_norm),
        (p + "self_attn.qkv_proj", (trace[p + "input_layernorm"],), (qkv,)),
        (p + "self_attn.rotary_emb", (torch.arange(qkv.shape[0]), part(trace[p + "self_attn.q_proj"], -1),
                                      part(trace[p + "self_attn.k_proj"], -1)),
         (heads("self_attn.q_rope"), heads("self_attn.k_rope"))),
        ("explicit", f"layers.{i}.attn_scores", part(trace[p + "self_attn.scores"], 0)[None], "1 h[tp] t s", i),
        ("explicit", f"layers.{i}.attn_probs", part(trace[p + "self_attn.probs"], 0), "h[tp] t s # dp:=attn_dp", i),
        (p + "self_attn.attn", (heads("self_attn.q_rope"),), (part(trace[p + "self_attn.context"], -1),)),
        (p + "self_attn.o_proj", (part(trace[p + "self_attn.context"], -1),), (trace[p + "self_attn.o_proj"],)),
        (p + "self_attn", (trace[p + "input_layernorm"],), (trace[p + "self_attn.o_proj"],)),
        (p + "post_attention_layernorm", (trace[p + "self_attn.o_proj"], residual_in),
         (trace[p + "post_attention_layernorm"], trace[p + "resid_mid"])),
        (p + "mlp.gate_up_proj", (trace[p + "post_attention_layernorm"],), (gate_up,)),
        (p + "mlp.act_fn", (gate_up,), (part(trace[p + "mlp.act"], -1),)),
        (p + "mlp.down_proj", (part(trace[p + "mlp.act"], -1),), (trace[p + "mlp.down_proj"],)),
        (p + "mlp", (trace[p + "post_attention_layernorm"],), (trace[p + "mlp.down_proj"],)),
        (p[:-1], (norm_in,), (trace[p + "mlp.down_proj"], trace[p + "resid_mid"])),  # (mlp output, residual)
    ]


def sglang_llama_dump(trace, folder: Path, ranks: int = 2, edit=None) -> Path:
    """A dump of `trace`'s forward as SGLang's dumper writes it for its own Llama at TP=`ranks`
    (non-intrusive mode "all", plus two explicit `dumper.dump` calls with `dims`): one file per tensor
    and rank named by its tags, `{"value", "meta"}` with `sglang_parallel_info`, saved by torch.save.
    Each rank's tensors are the trace's sliced as SGLang's parallel layers shard them: column-parallel
    outputs (fused qkv_proj [q_r, k_r, v_r], gate_up_proj [gate_r, up_r]), attention over its heads,
    row-parallel outputs all-reduced (whole), logits of the last position only.
    `edit(rank, name, tensor)` may return a changed tensor."""
    folder.mkdir(parents=True, exist_ok=True)
    layers = trace.meta.num_layers
    tokens = torch.tensor(trace.tokens)
    for rank in range(ranks):
        def part(tensor, axis, rank=rank):
            return tensor.chunk(ranks, dim=axis)[rank].contiguous()

        index = 0

        def dump(name, value, **extra):
            nonlocal index
            index += 1
            if edit is not None:
                value = edit(rank, name, value)
            tags = {"step": 0, "rank": rank, "dump_index": index, "name": name}
            meta = {**tags, "recompute_status": "disabled", **{k: v for k, v in extra.items() if k == "layer_id"},
                    "world_rank": rank, "world_size": ranks,
                    "sglang_parallel_info": {"tp_rank": rank, "tp_size": ranks, "pp_rank": 0, "pp_size": 1},
                    **{k: v for k, v in extra.items() if k != "layer_id"}}
            file_tags = {**tags, **{k: v for k, v in extra.items() if k == "layer_id"}}
            torch.save({"value": value, "meta": meta}, folder / ("___".join(f"{k}={v}" for k, v in file_tags.items())
                                                                  + ".pt"))

        def module(name, inputs, outputs, layer=None):
            ctx = {} if layer is None else {"layer_id": layer}
            for n, value in enumerate(inputs):
                dump(f"non_intrusive__{name}.inputs.{n}".replace("__.", "__"), value, **ctx)
            # a tuple with one tensor (a parallel linear's (output, None)) is dumped as that tensor
            for n, value in enumerate(outputs):
                dump(f"non_intrusive__{name}.output" + (f".{n}" if len(outputs) > 1 else ""), value, **ctx)

        for core, value in (("input_ids", tokens), ("positions", torch.arange(len(tokens))),
                            ("seq_lens", torch.tensor([len(tokens)]))):
            dump(core, value)
        module("", (tokens, torch.arange(len(tokens))), ())  # the root's inputs: input_ids, positions
        module("model.embed_tokens", (tokens,), (trace["model.embed_tokens"],))
        for i in range(layers):
            for entry in _sglang_layer_modules(trace, i, part):
                if entry[0] == "explicit":
                    dump(entry[1], entry[2], layer_id=entry[4], dims=entry[3])
                else:
                    module(*entry, layer=i)
        last = f"model.layers.{layers - 1}"
        module("model.norm", (trace[f"{last}.mlp.down_proj"], trace[f"{last}.resid_mid"]),
               (trace["model.norm"], trace[last]))
        module("model", (tokens,), (trace["model.norm"],))
        module("logits_processor", (tokens, trace["model.norm"]), ())
        dump("non_intrusive__logits_processor.output.next_token_logits", trace["lm_head"][-1:])
        dump("non_intrusive__output.next_token_logits", trace["lm_head"][-1:])
    return folder
