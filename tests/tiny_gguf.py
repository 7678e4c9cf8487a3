"""A tiny Llama directory (tests/conftest.py `write_tiny_llama`) written again as a real GGUF file,
the way llama.cpp's convert_hf_to_gguf.py writes a Llama: q/k weight rows permuted so that each
RoPE pair is adjacent (`tracer.traces.layouts.to_interleaved` on the output rows), f32 or f16 tensors,
and no tokenizer (`tokenizer.ggml.model = "no_vocab"`, the vocabulary size as metadata): tracer
feeds llama.cpp token ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from tracer.traces.layouts import to_interleaved

# HF tensor name (after "model.layers.{n}.") -> GGUF name (after "blk.{n}.")
LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.bias": "attn_output.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
PERMUTED = ("attn_q", "attn_k")  # rows in GGUF's interleaved order
NORMS = ("attn_norm", "ffn_norm", "output_norm")  # llama.cpp keeps norms in f32 whatever the file type


def llama_writer(path: Path, config: dict, head_dim: int, value_length: int | None = None):
    """A GGUFWriter for a Llama at `path` with the model's hyperparameters as llama.cpp reads them."""
    import gguf

    theta = config.get("rope_theta") or config["rope_parameters"]["rope_theta"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(value_length or head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(theta)
    writer.add_vocab_size(config["vocab_size"])
    return writer


def write_tiny_gguf(model_dir: Path, path: Path, *, dtype: str = "f32", value_length: int | None = None) -> Path:
    """`model_dir` (config.json + model.safetensors) as a GGUF file at `path`
    (`tracer.files.hf_to_gguf.write_gguf`, `dtype` f32 or f16).

    `value_length` (smaller than the head size) writes value heads that size, attn_v cut to match:
    a corrupt file llama.cpp 0.3.36 loads without complaint and then aborts on when it builds the
    graph, `GGML_ASSERT(n_embd_head == hparams.n_embd_head_k())` (keys and values must be one size).
    """
    import gguf

    from tracer.files.hf_to_gguf import write_gguf

    if value_length is None:  # the file a user's conversion writes (tracer's, as llama.cpp's converter)
        return write_gguf(model_dir, path, dtype)
    config = json.loads((model_dir / "config.json").read_text())
    weights = load_file(str(model_dir / "model.safetensors"))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer = llama_writer(path, config, head_dim, value_length)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    writer.add_tokenizer_model("no_vocab")
    tensors = gguf_tensors(weights, config, head_dim)
    if value_length:
        for n in range(config["num_hidden_layers"]):
            v = tensors[f"blk.{n}.attn_v.weight"]  # (KV·D, C) -> (KV·value_length, C)
            tensors[f"blk.{n}.attn_v.weight"] = (v.reshape(-1, head_dim, v.shape[1])[:, :value_length]
                                                 .reshape(-1, v.shape[1]))
    for name, tensor in tensors.items():
        keep_f32 = dtype == "f32" or tensor.ndim == 1 or name.split(".")[-2] in NORMS
        writer.add_tensor(name, tensor.numpy().astype(np.float32 if keep_f32 else np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_tensors(weights: dict[str, torch.Tensor], config: dict, head_dim: int) -> dict[str, torch.Tensor]:
    """HF tensors under GGUF names, q/k rows permuted; lm_head only when not tied."""
    out = {"token_embd.weight": weights["model.embed_tokens.weight"],
           "output_norm.weight": weights["model.norm.weight"]}
    if "lm_head.weight" in weights:
        out["output.weight"] = weights["lm_head.weight"]
    for n in range(config["num_hidden_layers"]):
        for hf_name, gguf_name in LAYER_TENSORS.items():
            tensor = weights.get(f"model.layers.{n}.{hf_name}")
            if tensor is None:
                continue
            if gguf_name.split(".")[0] in PERMUTED:  # output rows (dim 0) into GGUF's RoPE-pair order
                tensor = to_interleaved(tensor.T, head_dim).T if tensor.ndim == 2 else to_interleaved(tensor, head_dim)
            out[f"blk.{n}.{gguf_name}"] = tensor.contiguous()
    return out
