"""GGUF files the audit judges (`tracer.ggml.audit`): one with a block of one tensor changed, as
storage or a faulty tool damages a file (the bytes written at the offset `tracer.files.gguffile` gives,
nothing else touched), and the importance matrix llama-imatrix would compute from the reference's
own activations, for files quantized as users make them with one."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

# Where a block type keeps its (super-block) f16 scale d: the first two bytes, but for these.
SCALE_OFFSET = {"q2_k": 80, "q3_k": 108, "q6_k": 208}


def damage_block(source: Path, target: Path, tensor: str, block: int, *, quants: int = 0,
                 scale: float = 1.0) -> Path:
    """`source` copied to `target` with block `block` (row-major) of `tensor` ("blk.5.attn_k.weight")
    changed: the top bit of both nibbles flipped in `quants` bytes of its last quant field (4-bit
    quants move by 8 levels), and its f16 scale multiplied by `scale`."""
    from tracer.files.gguffile import GGML_TYPES, GGUFFile
    from tracer.ggml.audit import LEVELS

    info = GGUFFile(source).tensors[tensor]
    field = LEVELS[info.kind].fields[-1]
    scale_at = SCALE_OFFSET.get(info.kind, 0)
    size = next(nbytes for name, _, nbytes in GGML_TYPES.values() if name == info.kind)
    shutil.copyfile(source, target)
    with open(target, "r+b") as handle:
        offset = info.offset + block * size
        handle.seek(offset)
        data = np.frombuffer(handle.read(size), dtype=np.uint8).copy()  # (bytes,) the block
        for position in range(field[0], field[0] + quants):
            data[position] ^= 0x88  # each nibble's top bit: a quant moved by 8 levels
        if scale != 1.0:
            d = data[scale_at:scale_at + 2].view(np.float16)[0]
            data[scale_at:scale_at + 2] = np.array([d * scale], dtype=np.float16).view(np.uint8)
        handle.seek(offset)
        handle.write(data.tobytes())
    return target


# The point whose values each projection of a block multiplies (llama-imatrix collects the mean
# squared input of every matmul, per column).
PROJECTION_INPUTS = {"attn_q": "input_layernorm", "attn_k": "input_layernorm", "attn_v": "input_layernorm",
                     "attn_output": "self_attn.context", "ffn_gate": "post_attention_layernorm",
                     "ffn_up": "post_attention_layernorm", "ffn_down": "mlp.act"}


def activation_imatrix(model: Path, tokens) -> dict[str, np.ndarray]:
    """GGUF tensor name -> the mean square of each input column over `tokens`, from the model's own
    f32 forward (the reimplementation): what llama-imatrix computes on a prompt."""
    import tracer

    trace = tracer.record(model, tokens, engine="reimpl", progress=False)
    layers = trace.meta.num_layers
    matrix = {}
    for layer in range(layers):
        for tensor, point in PROJECTION_INPUTS.items():
            x = trace[f"model.layers.{layer}.{point}"].double()  # (T, C)
            matrix[f"blk.{layer}.{tensor}.weight"] = (x * x).mean(0).float().numpy()
    return matrix
