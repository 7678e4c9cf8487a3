"""Tiny random models of every family tracer traces, built from transformers' own config classes and
written with `save_pretrained` (config.json as transformers 5 writes it, model.safetensors).

Three layers, GQA (4 query heads, 2 kv heads), hidden 48 (so sqrt(hidden) is not exact in bf16),
head_dim 12, windows of 4 keys where the family has them (shorter than the 7-token test prompt),
tied and untied embeddings across the families. Weights are redrawn from a seeded generator at
scales where every feature shows (Gemma's norm weights are offsets around 0, the others' around 1).
"""

from __future__ import annotations

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
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(path)
    finally:
        if was:
            hf_logging.enable_progress_bar()
    return Path(path)


def write_tiny_gguf(model_dir: Path, path: Path, *, no_vocab: bool = False) -> Path:
    """The f32 GGUF llama.cpp would write for a tiny Qwen2 or Qwen3 directory (no tokenizer), by gguf's
    own writer and tensor-name map; `no_vocab` says so in the file, as llama.cpp needs to load it
    (token ids are fed directly). Returns the file."""
    import json

    import gguf
    from safetensors.torch import load_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    arch = {"qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}[config["model_type"]]
    writer = gguf.GGUFWriter(str(path), config["model_type"])
    writer.add_name(f"tiny {config['model_type']}")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    if "head_dim" in config:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if no_vocab:
        writer.add_tokenizer_model("no_vocab")
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    for name, tensor in load_file(str(Path(model_dir) / "model.safetensors")).items():
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
