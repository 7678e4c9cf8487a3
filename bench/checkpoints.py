"""Random-weight bf16 checkpoints of real Llama shapes, written as real checkpoints ship (sharded
safetensors with an index), for the benchmark's size axis. Written under bench/.bench-models/
(gitignored), never committed.

    python bench/checkpoints.py llama-1b            # the Llama-3.2-1B shape, 16 layers
    python bench/checkpoints.py llama-8b --layers 2 # the Llama-3-8B width, 2 of its 32 layers
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
MODELS = HERE / ".bench-models"

# The shapes of the published config.json files (Llama-3.2-1B, Meta-Llama-3-8B).
SHAPES = {
    "llama-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "head_dim": 64, "num_hidden_layers": 16, "tie_word_embeddings": True,
                 "rope_theta": 500000.0, "max_position_embeddings": 131072},
    "llama-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 32, "tie_word_embeddings": False,
                 "rope_theta": 500000.0, "max_position_embeddings": 8192},
}
VOCAB = 128256
SHARD_BYTES = 2 << 30  # about 2 GB per shard, as the hub's shards are 2–5 GB


def config(shape: str, layers: int | None = None) -> dict:
    dims = dict(SHAPES[shape])
    if layers is not None:
        dims["num_hidden_layers"] = layers
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
            "hidden_act": "silu", "rms_norm_eps": 1e-5, "attention_bias": False, "mlp_bias": False,
            "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16", **dims}


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """name -> shape, in the order a forward reads them (so that shards hold consecutive layers)."""
    c, f, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (VOCAB, c)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (c,), p + "self_attn.q_proj.weight": (q, c),
                   p + "self_attn.k_proj.weight": (kv, c), p + "self_attn.v_proj.weight": (kv, c),
                   p + "self_attn.o_proj.weight": (c, q), p + "post_attention_layernorm.weight": (c,),
                   p + "mlp.gate_proj.weight": (f, c), p + "mlp.up_proj.weight": (f, c),
                   p + "mlp.down_proj.weight": (c, f)}
    shapes["model.norm.weight"] = (c,)
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (VOCAB, c)
    return shapes


def random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    if len(shape) == 1:  # norm weights near 1, as trained ones are
        return (1 + 0.1 * torch.randn(shape, generator=generator)).to(torch.bfloat16)
    return (torch.randn(shape, generator=generator) * shape[-1] ** -0.5).to(torch.bfloat16)


def write_checkpoint(shape: str, layers: int | None = None, folder: Path | None = None) -> Path:
    """The checkpoint's folder (written once; an existing complete one is reused)."""
    from safetensors.torch import save_file

    cfg = config(shape, layers)
    folder = folder or MODELS / f"{shape}-{cfg['num_hidden_layers']}l"
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    names = tensor_shapes(cfg)
    weight_map, written = {}, []
    for name, dims in names.items():
        tensor = random_tensor(name, dims, generator)
        if size and size + tensor.nbytes > SHARD_BYTES:
            written.append(_save(folder, shards[-1], len(written), save_file))
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
    written.append(_save(folder, shards[-1], len(written), save_file))
    total = len(written)
    for number, (temporary, held) in enumerate(written):
        final = folder / f"model-{number + 1:05d}-of-{total:05d}.safetensors"
        temporary.rename(final)
        weight_map |= dict.fromkeys(held, final.name)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    total_bytes = sum(torch.Size(dims).numel() * 2 for dims in names.values())
    index_path.write_text(json.dumps({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, indent=2))
    return folder


def _save(folder: Path, tensors: dict[str, torch.Tensor], number: int, save_file) -> tuple[Path, list[str]]:
    path = folder / f"shard-{number}.tmp.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    names = list(tensors)
    tensors.clear()
    return path, names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, help="fewer (or more) layers than the shape's own")
    print(write_checkpoint(**vars(parser.parse_args())))


if __name__ == "__main__":
    main()
