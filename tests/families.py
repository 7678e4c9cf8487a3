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
                                   layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
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


# What llama.cpp's convert_hf_to_gguf.py (its conversion/ modules) writes beyond every family's metadata,
# family by family: tracer family -> (GGUF architecture, metadata writers, whether norm weights get +1).
# Llama and Mistral (both the "llama" architecture, q/k rows permuted) are tests/tiny_gguf.py's.
def _gemma2_metadata(writer, config):  # conversion/gemma.py Gemma2Model: no rope theta, no query scale
    writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
    writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    writer.add_sliding_window(config["sliding_window"])


def _gemma3_metadata(writer, config):  # Gemma3Model: the full layers' theta, the sliding ones', no pattern
    rope = config["rope_parameters"]
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if config.get("sliding_window_pattern") != 1:
        writer.add_sliding_window(config["sliding_window"])


def _phi3_metadata(writer, config):  # conversion/phi.py Phi3MiniModel: partial rotary as a rope dimension
    rope = config["rope_parameters"]
    writer.add_rope_freq_base(rope["rope_theta"])
    dims = int(rope.get("partial_rotary_factor", 1.0) * config["hidden_size"]) // config["num_attention_heads"]
    writer.add_rope_dimension_count(dims)
    writer.add_rope_scaling_orig_ctx_len(config["original_max_position_embeddings"])
    writer.add_sliding_window(config.get("sliding_window") or 0)


def _text_model_metadata(writer, config):  # conversion/base.py TextModel's, all these families need
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])


GGUF_FAMILIES = {
    "qwen2": ("QWEN2", _text_model_metadata, False), "qwen3": ("QWEN3", _text_model_metadata, False),
    "gemma2": ("GEMMA2", _gemma2_metadata, True), "gemma3": ("GEMMA3", _gemma3_metadata, True),
    "phi3": ("PHI3", _phi3_metadata, False), "olmo2": ("OLMO2", _text_model_metadata, False),
}
# llama.cpp's OLMo-2 loads only with an output matrix of its own (src/models/olmo2.cpp: `output` required);
# the converter writes none for tied embeddings, so a tied tiny OLMo-2 gets the embeddings as its output
# (real OLMo-2 checkpoints are untied)
UNTIED_OUTPUT = ("olmo2",)
MODEL_TYPES = {"gemma3_text": "gemma3"}  # config.json's model_type -> tracer family where they differ


def write_tiny_gguf(model_dir: Path, path: Path, *, no_vocab: bool = False) -> Path:
    """The f32 GGUF llama.cpp's converter writes for a tiny Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3 or OLMo-2
    directory (no tokenizer), by gguf's own writer and tensor-name map: the metadata each family's converter
    class writes (GGUF_FAMILIES), Gemma's norm weights +1 (its RMSNorm multiplies by 1 + weight), Phi-3's
    fused qkv and gate_up tensors as they are, a tied output matrix not written. `no_vocab` says so in the
    file, as llama.cpp needs to load it (token ids are fed directly; Gemma 3's converter would cut the
    embeddings to the tokenizer's size, here every row is a token). Returns the file."""
    import json

    import gguf
    from safetensors.torch import load_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    family = MODEL_TYPES.get(config["model_type"], config["model_type"])
    arch_name, metadata, norm_offset = GGUF_FAMILIES[family]
    arch = getattr(gguf.MODEL_ARCH, arch_name)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(f"tiny {family}")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    if "head_dim" in config:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    metadata(writer, config)
    if no_vocab:
        writer.add_tokenizer_model("no_vocab")
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    tensors = load_file(str(Path(model_dir) / "model.safetensors"))
    if family in UNTIED_OUTPUT and "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    for name, tensor in tensors.items():
        if norm_offset and name.endswith("norm.weight"):
            tensor = tensor + 1
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
