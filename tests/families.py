"""Tiny random models of every family tracer traces, built from transformers' own config classes and
written with `save_pretrained` (config.json as transformers 5 writes it, model.safetensors).

Three layers, GQA (4 query heads, 2 kv heads), hidden 48 (so sqrt(hidden) is not exact in bf16),
head_dim 12, windows of 4 keys where the family has them (shorter than the 7-token test prompt),
tied and untied embeddings across the families. Weights are redrawn from a seeded generator at
scales where every feature shows (Gemma's norm weights are offsets around 0, the others' around 1).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

BASE = dict(vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
WINDOW = 4  # keys a query sees on a sliding layer: fewer than the 7 test tokens

# tracer family -> (transformers model_type, config keys beyond BASE)
TINY_FAMILIES = {
    "llama": ("llama", dict(head_dim=12, tie_word_embeddings=True)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=False, use_sliding_window=True, sliding_window=WINDOW,
                            max_window_layers=1)),
    "qwen3": ("qwen3", dict(head_dim=12, tie_word_embeddings=True)),
    "mistral": ("mistral", dict(sliding_window=WINDOW, tie_word_embeddings=False)),
    "gemma2": ("gemma2", dict(head_dim=12, sliding_window=WINDOW, query_pre_attn_scalar=16, tie_word_embeddings=True,
                              attn_logit_softcapping=20.0, final_logit_softcapping=10.0)),
    "gemma3": ("gemma3_text", dict(head_dim=12, sliding_window=WINDOW, query_pre_attn_scalar=16,
                                   tie_word_embeddings=False,
                                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                   # layer_types' period, keyed as the hub's Gemma 3 configs write it (mlx-lm reads it)
                                   sliding_window_pattern=2)),
    "phi3": ("phi3", dict(sliding_window=WINDOW, tie_word_embeddings=False, partial_rotary_factor=0.5)),
    "olmo2": ("olmo2", dict(tie_word_embeddings=True)),
    # mixtures of experts: 4 experts, each token routed to 2, as the real configs' proportions scaled down;
    # 2 layers (their expert loops are the slow part of every test that runs each family)
    "mixtral": ("mixtral", dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                                sliding_window=WINDOW)),
    # a shared expert behind its sigmoid gate; layer 1 dense (mlp_only_layers), as its config may say
    "qwen2_moe": ("qwen2_moe", dict(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[1])),
    "qwen3_moe": ("qwen3_moe", dict(num_hidden_layers=2, head_dim=12, num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=32, norm_topk_prob=True)),
    "olmoe": ("olmoe", dict(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2)),
    # alternating sliding and full layers (its default layer_types), attention sinks, a biased router; the
    # SwiGLU's clamp at 1 rather than gpt-oss's 7, so that it bites on activations this small
    "gpt_oss": ("gpt_oss", dict(num_hidden_layers=2, head_dim=12, num_local_experts=4, num_experts_per_tok=2,
                                sliding_window=WINDOW, swiglu_limit=1.0, max_position_embeddings=131072)),
    # multi-head latent attention (every head its own key: kv heads = heads), 8 experts in 4 groups of which 2
    # are kept, top-2, a shared expert, layer 0 dense (first_k_dense_replace)
    "deepseek_v3": ("deepseek_v3", dict(num_hidden_layers=2, num_key_value_heads=4, n_routed_experts=8, n_group=4,
                                        topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
                                        moe_intermediate_size=32, n_shared_experts=1, kv_lora_rank=16,
                                        q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12)),
}
OFFSET_NORMS = ("gemma2", "gemma3")  # norm weights stored as offsets from 1


def family_config(family: str, **overrides):
    """transformers' config object of a tiny model of `family`."""
    from transformers import CONFIG_MAPPING

    model_type, extra = TINY_FAMILIES[family]
    return CONFIG_MAPPING[model_type](**{**BASE, **extra, **overrides})


def write_tiny_family(path: Path, family: str, *, seed: int = 0, **overrides) -> Path:
    """A random model of `family` saved by transformers into `path`. Returns the directory."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    config = family_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            noise = torch.randn(parameter.shape, generator=generator)
            if name.endswith("norm.weight"):
                parameter.copy_((0.0 if family in OFFSET_NORMS else 1.0) + 0.1 * noise)
            elif name.endswith("embed_tokens.weight"):
                parameter.copy_(noise)
            else:
                parameter.copy_(0.15 * noise)
        for name, buffer in model.named_buffers():  # DeepSeek-V3's selection bias (transformers starts it at 0)
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(path)
    finally:
        if was:
            hf_logging.enable_progress_bar()
    return Path(path)


# The keys the hub's configs (written by transformers 4) carry where transformers 5 writes others: Qwen3-MoE's
# expert count as num_experts (5: num_local_experts) and its theta at the top level (5: in rope_parameters).
# mlx-lm 0.32's qwen3_moe.py requires both, and cannot load a config without them (docs/engine-mlx.md).
HUB_KEYS = {"qwen3_moe": lambda config: {"num_experts": config["num_local_experts"],
                                         "rope_theta": config["rope_parameters"]["rope_theta"]}}


def with_hub_keys(path: Path, family: str) -> Path:
    """The model at `path` with the keys the hub's configs of `family` carry added to its config.json (the
    values transformers 5 wrote under its own keys, which transformers reads alike)."""
    file = Path(path) / "config.json"
    config = json.loads(file.read_text())
    file.write_text(json.dumps({**config, **HUB_KEYS[family](config)}, indent=2))
    return Path(path)


# llama.cpp's OLMo-2 loads only with an output matrix of its own (src/models/olmo2.cpp: `output` required);
# the converter writes none for tied embeddings, so a tied tiny OLMo-2 gets the embeddings as its output
# (real OLMo-2 checkpoints are untied)
UNTIED_OUTPUT = ("olmo2",)
MODEL_TYPES = {"gemma3_text": "gemma3"}  # config.json's model_type -> tracer family where they differ


def write_tiny_gguf(model_dir: Path, path: Path, *, no_vocab: bool = False) -> Path:
    """The f32 GGUF llama.cpp's converter writes for a tiny model directory (no tokenizer: the file says
    "no_vocab", which llama.cpp loads; token ids are fed directly), by tracer's own writer
    (`tracer.files.hf_to_gguf.write_gguf`, the same tensors and metadata as convert_hf_to_gguf.py). A tied
    OLMo-2 (`UNTIED_OUTPUT`) gets its embeddings as an output matrix first. `no_vocab` is kept for the
    callers that said so. Returns the file."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from tracer.files.hf_to_gguf import write_gguf

    model_dir, path = Path(model_dir), Path(path)
    config = json.loads((model_dir / "config.json").read_text())
    if MODEL_TYPES.get(config["model_type"], config["model_type"]) in UNTIED_OUTPUT:
        tensors = load_file(str(model_dir / "model.safetensors"))
        if "lm_head.weight" not in tensors:
            untied = path.parent / f"{path.stem}-untied"
            shutil.copytree(model_dir, untied, dirs_exist_ok=True)
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
            save_file(tensors, str(untied / "model.safetensors"), metadata={"format": "pt"})
            model_dir = untied
    return write_gguf(model_dir, path, "f32")
