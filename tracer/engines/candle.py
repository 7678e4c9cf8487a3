"""The `candle` engine: candle's own CPU kernels (the `candle-nn` 0.4.2 wheel, candle of March
2024) running candle-transformers 0.11's model files, op by op, recorded under tracer's points.

Two forwards, one per model source (`docs/engine-candle.md`):

- an HF directory (f32 safetensors): its family's model file. `models/llama.rs` — `candle_nn::Linear`
  without bias (`x.matmul(wᵀ)`), RMSNorm, `rope` (half-split) on HF rows, `repeat_kv` by concatenation,
  unfused attention (matmul, /sqrt(D), a u8 causal mask through `where_cond` with −inf, softmax,
  matmul; no mask for one token), SwiGLU, tied or untied `lm_head`. config.json is read as candle
  0.11's serde `LlamaConfig` reads it (`tracer.model.config.read_candle`: theta 10000 when it sits only
  under `rope_parameters`), unless the variant says `config=hf`. The other families' files (qwen2.rs,
  qwen3.rs, mistral.rs, gemma2.rs, gemma3.rs, phi3.rs, olmo2.rs) are the same forward with what each
  file adds (`Shape`: biases, q/k norms, Gemma's norms, scaled embeddings and soft-caps, Phi-3's fused
  projections and partial rotary, OLMo-2's post-norms, each file's window), their config.json read as
  the file's serde `Config` (`tracer.engines.candle_models`).
- a GGUF file (`candle:PATH.gguf`): `models/quantized_llama.rs` — `QTensor.matmul_t` on the file's
  own tensors (activations quantized to the weight's vec-dot type, then candle's vec_dot kernels),
  `rope_i` on the GGUF's permuted q/k rows, the embedding from the dequantized `token_embd`, the
  tied `lm_head` a quantized matmul on it. Settings come from the GGUF's metadata, as there.
  A Qwen2 GGUF runs `models/quantized_qwen2.rs` (q/k/v biases, `rope` on its unpermuted rows), a Qwen3
  GGUF `models/quantized_qwen3.rs` (per-head q/k norms), a Phi-3 GGUF `models/quantized_phi3.rs` (fused
  qkv and gate_up, theta 10000), a Gemma 3 GGUF `models/quantized_gemma3.rs` (Gemma 3's blocks with a
  SiLU MLP); a GGUF of an architecture with no quantized file is refused in one line.

0.4.2 has no fused `rms_norm`, `rope`, `rope_i` or `softmax_last_dim` (0.11 has them); each is
composed from candle's own ops in the order 0.11's CPU kernel computes (`COMPOSED`). Points come
out in tracer's names and HF layout (GGUF q/k rows un-permuted). Both forwards record every
position of `lm_head` (candle's own forward keeps the last position only; every row is the same
op on its own row).

candle's pyo3 wheel was built with `target-cpu=native` on an AVX2/FMA/F16C machine: on anything
else the engine refuses in one line before candle is imported (`check_platform`). It runs in the
child process of `tracer.engines.isolated`, as every native runtime does.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from tracer.core.errors import TracerError
from tracer.core.versions import installed_version
from tracer.engines.base import EngineBase, at_positions, decode_steps
from tracer.engines.candle_models import MODEL_FILES, flash_note
from tracer.engines.registry import ENGINES
from tracer.files.gguffile import GGUFFile
from tracer.files.sources import ModelSource, check_gguf_header
from tracer.ggml.candle import candle_inv_freq, rope_angles
from tracer.ggml.ops import cpu_flags
from tracer.model.component import family_of
from tracer.model.components.block import PRE_NORM, SANDWICH
from tracer.model.components.rope import rope_inv_freq
from tracer.model.config import RESAVES, load_config, variant_spec
from tracer.model.points import (
    BIAS,
    BLOCK_OUT,
    CACHE_K,
    CACHE_V,
    CONTEXT,
    DOWN_PROJ,
    EMBED,
    FINAL_LOGITS,
    FINAL_NORM,
    GATE_PROJ,
    GATE_UP_PROJ,
    INPUT_NORM,
    K_NORM,
    K_PROJ,
    K_ROPE,
    LOGITS,
    MLP_ACT,
    O_PROJ,
    POST_ATTENTION_NORM,
    PROBS,
    Q_NORM,
    Q_PROJ,
    Q_ROPE,
    QKV_PROJ,
    RESID_MID,
    SCORES,
    UP_PROJ,
    V_PROJ,
    WEIGHT,
    gguf_permuted,
    is_causal,
    layer_point,
    split_point,
)
from tracer.names.gguf import gguf_tensor_name
from tracer.traces.layouts import from_interleaved
from tracer.traces.trace import ATTENTION_ROWS, Trace, TraceMeta, TraceRecorder

REQUIRED_FLAGS = ("avx2", "fma", "f16c")  # the wheel's target-cpu=native build executes them
# Ops candle-transformers 0.11 calls as one fused CPU kernel that 0.4.2 lacks: composed here from
# candle's own ops, in the kernel's arithmetic. Only rms_norm's Σx² is summed in another order
# (0.4.2's vec_sum, where 0.11's kernel sums sequentially); rope, rope_i and softmax_last_dim
# compute the very same values.
COMPOSED = {
    "rms_norm": (INPUT_NORM, POST_ATTENTION_NORM, FINAL_NORM),
    "rope / rope_i": (Q_ROPE, K_ROPE),
    "softmax_last_dim": (PROBS,),
}
# candle's tanh-GELU kernel's constants (op.rs: SQRT_TWO_OVER_PI_F32, and 0.044715 as an f32).
SQRT_TWO_OVER_PI = float(np.float32(0.79788456080286535587989211986876373))
GELU_CUBIC = float(np.float32(0.044715))
SAME_CODE = ("candle 0.11's Q4_0/Q4_1/Q8_0/Q8_1 quantized arithmetic is the same code as 0.4.2's "
             "(k_quants.rs, avx.rs)")
K_QUANT_CAVEAT = ("this GGUF has K-quant tensors ({types}): candle 0.11 changed Q8_K's scale to -127/max, so "
                  "0.11 computes them otherwise than this 0.4.2 run")
# The GGUF tensor types candle 0.4.2 reads (`quantized::GgmlDType`; BF16 and the i-quants came later).
READABLE_TYPES = {"f32", "f16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q8_1", "q2_k", "q3_k", "q4_k", "q5_k",
                  "q6_k", "q8_k"}
# A block's weights, by the point of the module holding them: what llama.rs and quantized_llama.rs load
# (quantized_llama.rs by their GGUF names, `tracer.names.gguf.gguf_tensor_name`, gguf's TensorNameMap).
LAYER_WEIGHTS = (INPUT_NORM, Q_PROJ, K_PROJ, V_PROJ, O_PROJ, POST_ATTENTION_NORM, GATE_PROJ, UP_PROJ, DOWN_PROJ)
NORMS = (INPUT_NORM, POST_ATTENTION_NORM)
# The GGUF architectures (llama.cpp's names) candle:PATH.gguf runs, and the file of candle-transformers 0.11 that
# runs each: quantized_llama.rs; quantized_qwen2.rs (quantized_llama.rs with q/k/v biases and `rope` on the
# unpermuted rows); quantized_phi3.rs (fused qkv and gate_up, `rope` on the unpermuted rows, theta 10000 whatever
# the metadata says); quantized_qwen3.rs (per-head q/k norms; its fused CPU flash attention as qwen3.rs', composed by
# its standard path: `candle_models.QWEN3_FLASH`); quantized_gemma3.rs (`gemma3_gguf`).
GGUF_FILES = {"llama": "quantized_llama.rs", "qwen2": "quantized_qwen2.rs", "qwen3": "quantized_qwen3.rs",
              "phi3": "quantized_phi3.rs", "gemma3": "quantized_gemma3.rs"}
QWEN3_GGUF_FLASH = flash_note("quantized_qwen3.rs", "its \"standard matmul attention\", off the CPU")
# quantized_gemma3.rs' tensors: Gemma's sandwich norms and per-head q/k norms (llama.cpp stores each as 1 + w, so the
# file's plain rms_norm multiplies by what transformers' (1 + w) is), gate, up and down.
GEMMA3_GGUF_WEIGHTS = (*(p for pair in SANDWICH for p in pair), Q_PROJ, K_PROJ, V_PROJ, O_PROJ, Q_NORM, K_NORM,
                       GATE_PROJ, UP_PROJ, DOWN_PROJ)
# quantized_phi3.rs' tensors: attn_qkv and ffn_up (gate | up) fused, as phi3.rs' directory holds them.
PHI3_GGUF_WEIGHTS = (INPUT_NORM, QKV_PROJ, O_PROJ, POST_ATTENTION_NORM, GATE_UP_PROJ, DOWN_PROJ)

# --- the machine ---------------------------------------------------------------------------------


def check_platform(system: str | None = None, machine: str | None = None, flags: set[str] | None = None) -> None:
    """The wheel is manylinux x86-64 code compiled for AVX2/FMA/F16C: anything else is one line
    here, never an illegal-instruction crash inside candle."""
    system, machine = system or platform.system(), (machine or platform.machine()).lower()
    if system != "Linux" or machine not in ("x86_64", "amd64"):
        raise TracerError(f"the candle engine runs candle-nn's manylinux x86-64 wheel; this machine is "
                          f"{system} {machine}")
    missing = [flag for flag in REQUIRED_FLAGS if flag not in (cpu_flags() if flags is None else flags)]
    if missing:
        raise TracerError(f"the candle engine needs a CPU with {', '.join(REQUIRED_FLAGS)} (candle-nn's wheel is "
                          f"built for them); this one lacks {', '.join(missing)}")


def runtime() -> dict:
    """How reports name the runtime: "candle-nn 0.4.2 (candle kernels of March 2024)"."""
    return {"name": "candle-nn", "version": f"{installed_version('candle-nn')} (candle kernels of March 2024)"}


def composed(shape: Shape | None = None) -> dict[str, tuple[str, ...]]:
    """What this forward composes where 0.4.2 lacks 0.11's kernel: llama.rs' `COMPOSED`, or a family file's
    own (its candle_nn rms_norm points; gemma2.rs/gemma3.rs compose their norm themselves, op by op;
    the tanh GELU the binding lacks)."""
    if shape is None or shape.file == "llama.rs":
        return COMPOSED
    norms = () if shape.norm == "gemma" else (
        *(p for pair in shape.placement for p in pair if p is not None), FINAL_NORM,
        *((Q_NORM, K_NORM) if shape.qk_norm in ("per_head", "whole") else ()))
    out = {"rms_norm": norms, "rope / rope_i": (Q_ROPE, K_ROPE), "softmax_last_dim": (PROBS,)}
    if shape.act == "gelu_tanh":
        out["gelu (tanh)"] = (MLP_ACT,)
    return {kernel: points for kernel, points in out.items() if points}


def composed_text(shape: Shape | None = None) -> str:
    return "; ".join(f"{kernel}: {', '.join(points)}" for kernel, points in composed(shape).items())


# --- what the forward needs to know --------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """The model as candle's forward reads it."""

    num_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab_size: int
    max_positions: int
    eps: float
    inv_freq: np.ndarray  # (D/2,) f32: candle's `1f32 / theta.powf(i / D)`
    rope: str  # "half" (candle's rope) | "interleaved" (rope_i)
    gguf_rows: bool  # q/k weight rows in GGUF's permuted order: points un-permuted
    kv_repeat: str  # "interleave" (candle's repeat_kv) | "tile"
    mask: str  # "where" (candle's masked_fill -inf) | "additive" | "none"
    # What a model file other than llama.rs does (`tracer.engines.candle_models`); the defaults are llama.rs'.
    file: str = "llama.rs"
    biases: frozenset = frozenset()  # the projections with a bias (`linear_b`: x·wᵀ, then broadcast_add)
    qk_norm: str | None = None  # "per_head" (qwen3.rs), "whole" (olmo2.rs: over the projection), "gemma" (gemma3.rs)
    norm: str = "rms"  # "rms": candle_nn's rms_norm; "gemma": gemma2.rs/gemma3.rs' own (1 + w) RmsNorm, op by op
    placement: tuple = PRE_NORM  # ((before, after) attention, (before, after) MLP): the block's norms
    embed_scale: float | None = None  # Gemma's `xs * sqrt(hidden_size)`
    attn_softcap: float | None = None  # `(scores / cap).tanh() * cap`
    final_softcap: float | None = None
    windows: tuple = ()  # per layer: its sliding window, or None; () no layer has one
    local_inv_freq: np.ndarray | None = None  # the sliding layers' table (gemma3.rs' rope_local_base_freq)
    fused: bool = False  # phi3.rs' qkv_proj and gate_up_proj
    rotary_dim: int | None = None  # phi3.rs' partial_rotary_factor: the first dims of a head rotate
    long_inv_freq: np.ndarray | None = None  # phi3.rs' longrope: the positions from `original_max` on
    original_max: int | None = None
    act: str = "silu"  # the MLP's activation (`ACTIVATIONS`)


# --- the forward, from candle's ops -------------------------------------------------------------


class Cache:
    """candle-transformers' KV cache, as the forwards keep it (llama.rs' `Cache.kvs`, quantized_llama.rs'
    `LayerWeights.kv_cache`, the other files' `kv_cache` and qwen3.rs' `ConcatKvCache`): per layer the keys
    after RoPE and the values, (1, KV, S, D), each step's own concatenated after them along S
    (`Tensor::cat(&[cache_k, &k], 2)`): every token in position order (a windowed file's mask covers the
    prompt's own keys only, never what is cached), the layout such a cache is compared in
    (`tracer.model.kv_cache`); `position` is the `index_pos` the next forward is called with (the length of
    what the cache holds). gemma3.rs' rotating cache of its sliding layers is not this (refused)."""

    def __init__(self, num_layers: int):
        self.kvs: list[tuple[object, object] | None] = [None] * num_layers
        self.position = 0


class Forward:
    """One forward over a prompt (or, with a `Cache`, over the tokens after what it holds), composed
    from candle's ops as the shape's model file computes it, each point handed to `record` as a candle
    tensor with a batch dimension."""

    def __init__(self, shape: Shape, weights: dict, linear, candle):
        self.shape, self.weights, self.linear, self.candle = shape, weights, linear, candle

    def __call__(self, tokens: list[int], record, cache: Cache | None = None) -> object:
        c, s = self.candle, self.shape
        count = len(tokens)
        start = 0 if cache is None else cache.position  # index_pos
        ids = c.tensor([int(t) for t in tokens])
        h = self.weights[EMBED].index_select(ids, 0).reshape((1, count, s.hidden))  # (1, T, C)
        if s.embed_scale is not None:  # gemma2.rs/gemma3.rs: `xs * (hidden_size as f64).sqrt()`, an affine
            h = h * s.embed_scale
        record(EMBED, h)
        positions = np.arange(start, start + count)
        tables = {False: self._rotary(s.inv_freq, positions)}
        if s.local_inv_freq is not None:
            tables[True] = self._rotary(s.local_inv_freq, positions)
        windows = s.windows or (None,) * s.num_layers
        masks = {window: self._mask(count, start, window) for window in set(windows)}
        for i in range(s.num_layers):
            local = windows[i] is not None and s.local_inv_freq is not None
            cos, sin = tables[local]
            h = self.layer(h, i, cos, sin, masks[windows[i]], lambda sub, t, i=i: record(layer_point(i, sub), t),
                           cache)
        h = self.norm(h, self.weights[FINAL_NORM])
        record(FINAL_NORM, h)
        logits = self.linear(h, self.weights[LOGITS])  # (1, T, V)
        record(LOGITS, logits)
        if s.final_softcap is not None:
            logits = self.softcap(logits, s.final_softcap)
            record(FINAL_LOGITS, logits)
        if cache is not None:
            cache.position = start + count
        return logits

    def _rotary(self, inv_freq: np.ndarray, positions: np.ndarray) -> tuple:
        """cos, sin (T, D/2) of the file's table at `positions` (candle narrows its table of every position at
        index_pos: the same products, row by row); phi3.rs' longrope table takes its long factors from
        original_max_position_embeddings on."""
        s = self.shape
        angles = rope_angles(inv_freq, positions)
        if s.long_inv_freq is not None and s.original_max is not None:
            late = positions >= s.original_max
            angles[late] = rope_angles(s.long_inv_freq, positions[late])
        angles = self.candle.tensor(angles.tolist())  # (T, D/2)
        return angles.cos(), angles.sin()

    def layer(self, x, i: int, cos, sin, mask, record, cache: Cache | None = None):
        """One block, its norms where the file places them (`Shape.placement`: before and after each sublayer)."""
        w = self.weights[i]
        (attn_in, attn_out), (mlp_in, mlp_out) = self.shape.placement
        h = self._normed(x, w, attn_in, record)
        h = self.attention(h, w, cos, sin, mask, record, None if cache is None else (cache, i))
        h = self._normed(h, w, attn_out, record)
        x = x + h
        record(RESID_MID, x)
        h = self._normed(x, w, mlp_in, record)
        h = self.mlp(h, w, record)
        h = self._normed(h, w, mlp_out, record)
        x = x + h
        record(BLOCK_OUT, x)
        return x

    def _normed(self, x, w: dict, point: str | None, record):
        if point is None:
            return x
        x = self.norm(x, w[point])
        record(point, x)
        return x

    def mlp(self, x, w: dict, record):
        if self.shape.fused:  # phi3.rs: one gate_up_proj, narrowed into gate | up
            both = self.linear(x, w[GATE_UP_PROJ])
            record(GATE_UP_PROJ, both)
            width = both.shape[-1] // 2
            gate, up = both.narrow(-1, 0, width), both.narrow(-1, width, width)
        else:
            gate, up = self.linear(x, w[GATE_PROJ]), self.linear(x, w[UP_PROJ])
            record(GATE_PROJ, gate)
            record(UP_PROJ, up)
        act = self.activation(gate) * up
        record(MLP_ACT, act)
        h = self.linear(act, w[DOWN_PROJ])
        record(DOWN_PROJ, h)
        return h

    def project(self, x, w: dict, point: str):
        """`linear_b`: x·wᵀ, then the bias broadcast-added where the file loads one."""
        out = self.linear(x, w[point])
        return out.broadcast_add(w[point + BIAS]) if point in self.shape.biases else out

    def attention(self, x, w: dict, cos, sin, mask, record, slot: tuple[Cache, int] | None = None):
        s = self.shape
        count = x.shape[1]
        q_width, kv_width = s.heads * s.head_dim, s.kv_heads * s.head_dim
        if s.fused:  # phi3.rs: qkv_proj narrowed into q | k | v
            qkv = self.linear(x, w[QKV_PROJ])
            record(QKV_PROJ, qkv)
            q, k, v = qkv.narrow(-1, 0, q_width), qkv.narrow(-1, q_width, kv_width), \
                qkv.narrow(-1, q_width + kv_width, kv_width)
        else:
            q, k, v = self.project(x, w, Q_PROJ), self.project(x, w, K_PROJ), self.project(x, w, V_PROJ)
            record(Q_PROJ, q)
            if s.qk_norm == "whole":  # olmo2.rs: candle_nn's RmsNorm over the whole projection, before the heads
                q = self.rms_norm(q, w[Q_NORM])
                record(Q_NORM, q)
            record(K_PROJ, k)
            if s.qk_norm == "whole":
                k = self.rms_norm(k, w[K_NORM])
                record(K_NORM, k)
            record(V_PROJ, v)
        q = q.reshape((1, count, s.heads, s.head_dim)).transpose(1, 2).contiguous()  # (1, H, T, D)
        k = k.reshape((1, count, s.kv_heads, s.head_dim)).transpose(1, 2).contiguous()  # (1, KV, T, D)
        v = v.reshape((1, count, s.kv_heads, s.head_dim)).transpose(1, 2).contiguous()  # (1, KV, T, D)
        if s.qk_norm in ("per_head", "gemma"):  # qwen3.rs, gemma3.rs: over D, per head, before RoPE
            norm = self.rms_norm if s.qk_norm == "per_head" else self.gemma_norm
            q, k = norm(q, w[Q_NORM]), norm(k, w[K_NORM])
            record(Q_NORM, q.transpose(1, 2).reshape((1, count, q_width)))  # (1, T, H·D): the projections' layout
            record(K_NORM, k.transpose(1, 2).reshape((1, count, kv_width)))  # (1, T, KV·D)
        q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        record(Q_ROPE, q)
        record(K_ROPE, k)
        if slot is not None:  # the cache: what it held, then this forward's keys and values along S
            cache, i = slot
            if cache.kvs[i] is not None:
                held_k, held_v = cache.kvs[i]
                k, v = self.candle.cat([held_k, k], 2), self.candle.cat([held_v, v], 2)  # (1, KV, S, D)
            cache.kvs[i] = (k, v)
            record(CACHE_K, k)
            record(CACHE_V, v)
        k, v = self.repeat_kv(k), self.repeat_kv(v)  # (1, H, S, D)
        scores = q.matmul(k.t()) / float(np.sqrt(s.head_dim))  # (1, H, T, S): an affine by 1/sqrt(D), as 0.11
        if s.attn_softcap is not None:
            scores = self.softcap(scores, s.attn_softcap)
        record(SCORES, scores)
        probs = self.softmax_last_dim(self._masked(scores, mask))
        record(PROBS, probs)
        context = probs.matmul(v.contiguous()).transpose(1, 2).reshape((1, count, q_width))  # (1, T, H·D)
        record(CONTEXT, context)
        out = self.project(context, w, O_PROJ)
        record(O_PROJ, out)
        return out

    def rotate(self, x, cos, sin):
        """The file's RoPE: rope or rope_i over the head, or (phi3.rs' partial_rotary_factor) over its first
        `rotary_dim` dims, the rest passed through (`Tensor::cat(&[&xs_rot, &xs_pass], D::Minus1)`)."""
        rope = self.rope_i if self.shape.rope == "interleaved" else self.rope
        dim = self.shape.rotary_dim
        if dim is None or dim == x.shape[-1]:
            return rope(x, cos, sin)
        rotated = rope(x.narrow(-1, 0, dim).contiguous(), cos, sin)
        return self.candle.cat([rotated, x.narrow(-1, dim, x.shape[-1] - dim)], -1).contiguous()

    def norm(self, x, weight):
        return self.gemma_norm(x, weight) if self.shape.norm == "gemma" else self.rms_norm(x, weight)

    def gemma_norm(self, x, weight):
        """gemma2.rs/gemma3.rs' own RmsNorm, op by op: `x.sqr().sum_keepdim(D::Minus1) / hidden_size as f64`
        (an affine by 1/n), `+ eps`, sqrt, `x.broadcast_div(..)`, times `weight + 1.0`."""
        mean = x.sqr().sum_keepdim(x.rank - 1) / float(x.shape[-1])  # (1, ..., 1)
        return x.broadcast_div((mean + self.shape.eps).sqrt()).broadcast_mul(weight + 1.0)

    def softcap(self, x, cap: float):
        """`((x / cap)?.tanh()? * cap)`: two affines around candle's tanh."""
        return self.candle.functional.tanh(x / cap) * cap

    def activation(self, x):
        """candle_nn::Activation: silu, relu, `gelu_erf` (serde's "gelu") and `gelu` (tanh, for gelu_pytorch_tanh
        and gelu_new), which 0.4.2's binding lacks: composed as candle's f32 kernel computes it,
        `0.5 * v * (1.0 + tanh(SQRT_TWO_OVER_PI * v * (1.0 + 0.044715 * v * v)))`, left to right."""
        functional = self.candle.functional
        kind = self.shape.act
        if kind == "gelu_tanh":
            inner = (x * GELU_CUBIC) * x + 1.0
            return (x * 0.5) * (functional.tanh((x * SQRT_TWO_OVER_PI) * inner) + 1.0)
        return {"silu": functional.silu, "gelu_erf": functional.gelu, "relu": functional.relu}[kind](x)

    # --- 0.11's fused kernels, composed -------------------------------------------------------

    def rms_norm(self, x, weight):
        """candle_nn::ops::rms_norm: m = sqrt(Σx²/n + eps) (a true division by n, then eps added
        in f32), out = x / m * alpha."""
        c = self.candle
        n = c.tensor(float(x.shape[-1]))
        m = (x.sqr().sum_keepdim(x.rank - 1).broadcast_div(n) + self.shape.eps).sqrt()  # (1, ..., 1)
        return x.broadcast_div(m).broadcast_mul(weight)

    def rope(self, x, cos, sin):
        """rotary_emb::rope (half-split): out[i] = x[i]·cos − x[i+D/2]·sin, out[i+D/2] = x[i]·sin + x[i+D/2]·cos."""
        half = x.shape[-1] // 2
        x1, x2 = x.narrow(-1, 0, half), x.narrow(-1, half, half)  # (1, H, T, D/2) each
        return self.candle.cat([x1.broadcast_mul(cos) - x2.broadcast_mul(sin),
                                x1.broadcast_mul(sin) + x2.broadcast_mul(cos)], -1)

    def rope_i(self, x, cos, sin):
        """rotary_emb::rope_i (adjacent pairs): out[2i] = x[2i]·cos − x[2i+1]·sin,
        out[2i+1] = x[2i]·sin + x[2i+1]·cos."""
        b, heads, count, dim = x.shape
        pairs = x.reshape((b, heads, count, dim // 2, 2))  # (1, H, T, D/2, 2)
        x0, x1 = pairs.narrow(-1, 0, 1), pairs.narrow(-1, 1, 1)  # (1, H, T, D/2, 1) each
        cos, sin = cos.reshape((count, dim // 2, 1)), sin.reshape((count, dim // 2, 1))
        rotated = self.candle.cat([x0.broadcast_mul(cos) - x1.broadcast_mul(sin),
                                   x0.broadcast_mul(sin) + x1.broadcast_mul(cos)], -1)  # (1, H, T, D/2, 2)
        return rotated.reshape((b, heads, count, dim))

    def softmax_last_dim(self, x):
        """ops::softmax_last_dim: exp(x − max), summed by vec_sum, each divided by the sum (candle_nn's
        softmax over the last dim is these very ops)."""
        return self.candle.functional.softmax(x, -1)

    def repeat_kv(self, x):
        """utils::repeat_kv: n copies concatenated along T, reshaped: each kv head repeated in place
        (transformers' order); `tile` concatenates along the heads instead."""
        groups = self.shape.heads // self.shape.kv_heads
        if groups == 1:
            return x
        b, kv, count, dim = x.shape
        if self.shape.kv_repeat == "tile":
            return self.candle.cat([x] * groups, 1)  # (1, KV·n, T, D), head h reads kv h % KV
        return self.candle.cat([x] * groups, 2).reshape((b, kv * groups, count, dim))  # (1, KV·n, T, D)

    def _mask(self, count: int, start: int = 0, window: int | None = None):
        """utils::build_causal_mask(seq_len, index_pos): u8 (T, start + T), 1 where key j > start + i.
        None for one token (no mask, as candle). With a window, the other files' mask (qwen2.rs,
        mistral.rs, gemma2.rs, gemma3.rs: `i < j || j + sliding_window < i` over the prompt's own
        (T, T), the cached keys before it never masked); their additive 0 / −inf gives the very values
        `where_cond` with −inf does."""
        if count == 1 or self.shape.mask == "none":
            return None
        keys = start + count
        blocked = [int(j > start + i or (window is not None and j >= start and j - start + window < i))
                   for i in range(count) for j in range(keys)]
        return self.candle.tensor(blocked).reshape((count, keys)).to_dtype(self.candle.u8)

    def _masked(self, scores, mask):
        if mask is None:
            return scores
        c = self.candle
        if self.shape.mask == "additive":  # transformers' min-float add, the knob's contrast
            added = mask.to_dtype(c.f32) * float(np.finfo(np.float32).min)
            return scores.broadcast_add(added)
        neg_inf = c.tensor(float("-inf")).broadcast_as(scores.shape)
        return mask.broadcast_as(scores.shape).where_cond(neg_inf, scores)


def linear_f32(x, weight):
    """candle_nn::Linear without bias on a (1, T, C) input: x.matmul(w.broadcast_left(1).t())."""
    return x.matmul(weight.broadcast_left((x.shape[0],)).t())


def linear_quantized(x, weight):
    """QMatMul: QTensor.matmul_t on the (T, C) rows (activations quantized per row to the weight's
    vec-dot type, then candle's vec_dot per output)."""
    b, count, width = x.shape
    return weight.matmul_t(x.reshape((b * count, width))).reshape((b, count, weight.shape[0]))


# --- loading -------------------------------------------------------------------------------------


def refuse_family(family: str) -> None:
    """A family the entry's cells refuse (the GGUF path reaches here without `tracer.engines.load`'s check)."""
    refusal = ENGINES["candle"].refusal(family)
    if refusal:
        raise TracerError(refusal)


def hf_model(model_dir: Path, variant: dict, candle) -> tuple[Shape, dict, object, dict]:
    """An HF directory in its family's model file (llama.rs, or `candle_models.MODEL_FILES`): (shape,
    weights by point, linear, config facts for the trace)."""
    config = load_config(model_dir)
    family = family_of(config.get("model_type")).name
    refuse_family(family)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise TracerError(f"no *.safetensors in {model_dir}")
    tensors = {}
    for file in files:
        tensors.update(candle.utils.load_safetensors(str(file)))

    def tensor(name: str):
        if name not in tensors:
            raise TracerError(f"{model_dir}: no tensor {name} (candle's VarBuilder would fail the same way)")
        return tensors[name].to_dtype(candle.f32)

    if family != "llama":
        return family_model(family, config, variant, tensor, tensors)
    knobs = {"config": "candle", **variant}
    spec = variant_spec(config, {k: v for k, v in knobs.items() if k in ("config", "resave", "theta", "eps")})
    weights: dict = {EMBED: tensor(EMBED + WEIGHT), FINAL_NORM: tensor(FINAL_NORM + WEIGHT)}
    weights[LOGITS] = weights[EMBED] if spec.tie_word_embeddings else tensor(LOGITS + WEIGHT)
    for i in range(spec.num_hidden_layers):
        weights[i] = {point: tensor(layer_point(i, point) + WEIGHT) for point in LAYER_WEIGHTS}
    kind = None if spec.rope_scaling is None else spec.rope_scaling["rope_type"]
    if kind not in (None, "llama3", "linear"):  # an attention factor or a length-dependent table llama.rs lacks
        raise TracerError(f"the candle engine rotates with llama3 or linear rope scaling only; this model's rope_type "
                          f"is {kind!r}")
    inv_freq = candle_inv_freq(spec.rope_theta, spec.head_dim) if kind is None else \
        rope_inv_freq(spec).to(torch.float32).numpy()
    shape = Shape(spec.num_hidden_layers, spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim,
                  spec.hidden_size, spec.vocab_size, spec.max_position_embeddings, spec.rms_norm_eps, inv_freq,
                  variant.get("rope", "half"), False, variant.get("kv_repeat", "interleave"),
                  variant.get("mask", "where"))
    facts = {"reader": knobs["config"], "rope_theta": spec.rope_theta, "rms_norm_eps": spec.rms_norm_eps,
             "unused_config_keys": list(spec.unused_keys), "config": RESAVES[knobs.get("resave", "none")](config)}
    return shape, weights, linear_f32, facts


def family_model(family: str, config: dict, variant: dict, tensor, tensors: dict) -> tuple[Shape, dict, object, dict]:
    """A family's own model file (qwen2.rs, gemma2.rs, ...): config.json read as its serde Config
    (`candle_models`), its weights by point, what the reading noted."""
    model_file = MODEL_FILES[family]
    refused = [k for k in ("config", "resave") if k in variant]
    if refused:
        raise TracerError(f"{refused[0]}= changes how llama.rs reads config.json; candle's {model_file.name} reads "
                          "its own Config")
    built, notes, unread = model_file.read(config)
    theta, eps = float(variant.get("theta", built.pop("theta"))), float(variant.get("eps", built.pop("eps")))
    head_dim, rotary_dim, longrope = built["head_dim"], built.pop("rotary_dim", None), built.pop("longrope", None)
    dim = rotary_dim or head_dim

    def table(base: float, factors=None) -> np.ndarray:
        return candle_inv_freq(base, dim, f64=not model_file.f32_rope, factors=factors)

    local_theta = built.pop("local_theta", None)
    lm_head = built.pop("lm_head")
    shape = Shape(
        built.pop("num_layers"), built.pop("heads"), built.pop("kv_heads"), built.pop("head_dim"), built.pop("hidden"),
        built.pop("vocab_size"), built.pop("max_positions"), eps,
        table(theta, None if longrope is None else longrope["short_factor"]),
        variant.get("rope", "half"), False, variant.get("kv_repeat", "interleave"), variant.get("mask", "where"),
        file=model_file.name, rotary_dim=rotary_dim,
        local_inv_freq=None if local_theta is None else table(local_theta),
        long_inv_freq=None if longrope is None else table(theta, longrope["long_factor"]), **built)
    embed = tensor(EMBED + WEIGHT)
    if lm_head == "lm_head if present":  # qwen2.rs: `vb.contains_tensor("lm_head.weight")`
        lm_head = "lm_head" if LOGITS + WEIGHT in tensors else "embed"
    weights: dict = {EMBED: embed, FINAL_NORM: tensor(FINAL_NORM + WEIGHT),
                     LOGITS: embed if lm_head == "embed" else tensor(LOGITS + WEIGHT)}
    (attn_in, attn_out), (mlp_in, mlp_out) = shape.placement
    points = [p for p in (attn_in, attn_out, mlp_in, mlp_out) if p is not None]
    points += [QKV_PROJ, GATE_UP_PROJ] if shape.fused else [Q_PROJ, K_PROJ, V_PROJ, GATE_PROJ, UP_PROJ]
    points += [O_PROJ, DOWN_PROJ] + ([Q_NORM, K_NORM] if shape.qk_norm else [])
    for i in range(shape.num_layers):
        weights[i] = {point: tensor(layer_point(i, point) + WEIGHT) for point in points}
        weights[i].update({point + BIAS: tensor(layer_point(i, point) + BIAS) for point in shape.biases})
    facts = {"reader": model_file.name, "rope_theta": theta, "rms_norm_eps": eps, "unused_config_keys": unread,
             "config": config, "notes": notes}
    return shape, weights, linear_f32, facts


def gguf_model(path: Path, variant: dict, candle) -> tuple[Shape, dict, object, dict]:
    """quantized_llama.rs on a GGUF file: settings from its metadata, projections as QTensors."""
    refused = [k for k in ("config", "resave") if k in variant]
    if refused:
        raise TracerError(f"{refused[0]}= changes how config.json is read; candle:{path.name} reads the GGUF's "
                          "metadata (quantized_llama.rs)")
    file = GGUFFile(path)  # the metadata first: a family candle's Llama cannot run loads nothing
    architecture = str(file.fields.get("general.architecture", "llama"))  # llama.cpp's architecture names
    refuse_family(architecture)
    if architecture not in GGUF_FILES:
        raise TracerError(f"candle-transformers 0.11 has no quantized_{architecture}.rs: candle runs the model "
                          f"directory of {architecture} only")
    source = GGUF_FILES[architecture]
    unreadable = sorted({info.kind for info in file.tensors.values()} - READABLE_TYPES)
    if unreadable:
        raise TracerError(f"candle-nn 0.4.2 cannot read {', '.join(t.upper() for t in unreadable)} tensors "
                          f"(its GgmlDType has no such type): {path.name} cannot run in this candle")
    tensors, meta = candle.utils.load_gguf(str(path))

    def number(key: str, default=None):
        value = meta.get(f"{architecture}.{key}", default)
        if value is None:
            raise TracerError(f"{path.name}: no {architecture}.{key} in the GGUF metadata ({source} needs it)")
        return value

    def tensor(point: str):
        name = gguf_tensor_name(point, architecture)  # llama.cpp's architecture names are tracer's families here
        if name not in tensors:
            raise TracerError(f"{path.name}: no tensor {name} ({source} would fail the same way)")
        return tensors[name]

    if architecture == "gemma3":
        return gemma3_gguf(path, variant, tensors, meta, number, tensor, source)
    heads, hidden = int(number("attention.head_count")), int(number("embedding_length"))
    llama, qwen2, qwen3, phi3 = (architecture == name for name in ("llama", "qwen2", "qwen3", "phi3"))
    # quantized_qwen2.rs, quantized_qwen3.rs and quantized_phi3.rs: head_dim = embedding_length / head_count (Qwen3:
    # attention.key_length), the kv heads and the context length required (`md_get` bails), `rope` on llama.cpp's
    # unpermuted rows
    head_dim = int(number("rope.dimension_count", hidden // heads)) if llama else \
        int(number("attention.key_length")) if qwen3 else hidden // heads
    kv_heads = int(number("attention.head_count_kv", heads if llama else None))
    context = int(number("context_length", 4096 if llama else None))
    notes = []
    if phi3:
        # precomput_freqs_cis(rope_dim, max_seq_len, 10_000.): rope.freq_base is not read; `rope` takes the head
        rope_dim = int(number("rope.dimension_count"))
        number("feed_forward_length")  # gate | up's split, as ffn_up's halves
        if rope_dim != head_dim:
            # quantized_phi3.rs rotates the whole head with a table of rope.dimension_count dims: candle_nn's rope bails
            raise TracerError(f"candle refused: inconsistent last dim size in rope (head {head_dim}, "
                              f"rope.dimension_count {rope_dim}: quantized_phi3.rs)")
        base = meta.get("phi3.rope.freq_base")
        if base is not None and float(base) != 10000.0:
            notes.append(f"candle's quantized_phi3.rs rotates with theta 10000: the GGUF's rope.freq_base "
                         f"({float(base):g}) is not read")
        theta = float(variant.get("theta", 10000.0))
    else:  # quantized_qwen3.rs requires it
        theta = float(variant.get("theta", number("rope.freq_base", None if qwen3 else 10000.0)))
    if qwen3:
        notes.append(QWEN3_GGUF_FLASH)
    eps = float(variant.get("eps", np.float32(number("attention.layer_norm_rms_epsilon"))))
    embed = tensor(EMBED + WEIGHT)
    # tied: quantized_llama.rs and quantized_qwen2.rs take token_embd; quantized_phi3.rs requires output.weight
    output = tensor(LOGITS + WEIGHT) if phi3 else tensors.get(gguf_tensor_name(LOGITS + WEIGHT, architecture), embed)
    weights: dict = {EMBED: embed.dequantize(), FINAL_NORM: tensor(FINAL_NORM + WEIGHT).dequantize(), LOGITS: output}
    layers = int(number("block_count"))
    biases = frozenset({Q_PROJ, K_PROJ, V_PROJ}) if qwen2 else frozenset()  # quantized_qwen2.rs: attn_{q,k,v}.bias
    points = PHI3_GGUF_WEIGHTS if phi3 else (*LAYER_WEIGHTS, Q_NORM, K_NORM) if qwen3 else LAYER_WEIGHTS
    for i in range(layers):
        weights[i] = {point: tensor(layer_point(i, point) + WEIGHT) for point in points}
        for norm in (*NORMS, Q_NORM, K_NORM) if qwen3 else NORMS:
            weights[i][norm] = weights[i][norm].dequantize()
        for point in biases:
            weights[i][point + BIAS] = tensor(layer_point(i, point) + BIAS).dequantize()
    shape = Shape(layers, heads, kv_heads, head_dim, hidden, embed.shape[0], context, eps,
                  candle_inv_freq(theta, head_dim, f64=qwen3), variant.get("rope", "interleaved" if llama else "half"),
                  llama, variant.get("kv_repeat", "interleave"), variant.get("mask", "where"), file=source,
                  biases=biases, fused=phi3, qk_norm="per_head" if qwen3 else None)
    types = sorted({str(t.ggml_dtype) for t in tensors.values()})
    return shape, weights, linear_quantized, {"gguf_types": types, "rope_theta": theta, "rms_norm_eps": eps,
                                              "notes": notes}


def gemma3_gguf(path: Path, variant: dict, tensors: dict, meta: dict, number, tensor, source: str):
    """quantized_gemma3.rs on a Gemma 3 GGUF: its `gemma3.*` metadata (key_length, sliding_window required;
    sliding_window_type 6, rope.freq_base 1e6, rope.local_freq_base 1e4 when absent), embeddings × sqrt(hidden),
    candle_nn's rms_norm on the stored (1 + w) sandwich and per-head q/k norms, f32 RoPE tables (the local one on
    every layer but each sliding_window_type-th, masked to sliding_window + 1 keys), scores by 1/sqrt(key_length),
    no soft-caps, and a SiLU MLP."""
    heads, hidden, head_dim = (int(number(key)) for key in ("attention.head_count", "embedding_length",
                                                            "attention.key_length"))
    layers, window = int(number("block_count")), int(number("attention.sliding_window"))
    pattern = int(number("attention.sliding_window_type", 6))
    theta = float(variant.get("theta", number("rope.freq_base", 1e6)))
    local_theta = float(number("rope.local_freq_base", 1e4))
    eps = float(variant.get("eps", np.float32(number("attention.layer_norm_rms_epsilon"))))
    notes = ["candle's quantized_gemma3.rs computes the MLP with SiLU (`candle_nn::ops::silu`), not Gemma's tanh "
             "GELU; it applies no soft-cap and scales scores by 1/sqrt(key_length)"]
    swa = meta.get("gemma3.rope.freq_base_swa")
    if "gemma3.rope.local_freq_base" not in meta and swa is not None:
        notes.append(f"candle's quantized_gemma3.rs reads rope.local_freq_base (absent: 10000); the GGUF's "
                     f"rope.freq_base_swa ({float(swa):g}), which llama.cpp writes, is not read")
    if "gemma3.attention.sliding_window_type" not in meta:
        notes.append(f"candle's quantized_gemma3.rs makes every layer but each 6th sliding (no "
                     f"attention.sliding_window_type in the GGUF), masked to sliding_window + 1 = {window + 1} keys")
    embed = tensor(EMBED + WEIGHT)
    weights: dict = {EMBED: embed.dequantize(), FINAL_NORM: tensor(FINAL_NORM + WEIGHT).dequantize(),
                     LOGITS: tensors.get(gguf_tensor_name(LOGITS + WEIGHT, "gemma3"), embed)}  # tied: token_embd
    for i in range(layers):
        weights[i] = {point: tensor(layer_point(i, point) + WEIGHT) for point in GEMMA3_GGUF_WEIGHTS}
        for point in (*(p for pair in SANDWICH for p in pair), Q_NORM, K_NORM):
            weights[i][point] = weights[i][point].dequantize()
    shape = Shape(layers, heads, int(number("attention.head_count_kv")), head_dim, hidden, embed.shape[0], 131072,
                  eps, candle_inv_freq(theta, head_dim), variant.get("rope", "half"), False,
                  variant.get("kv_repeat", "interleave"), variant.get("mask", "where"), file=source,
                  qk_norm="per_head", placement=SANDWICH, embed_scale=math.sqrt(hidden),
                  windows=tuple(window if (i + 1) % pattern else None for i in range(layers)),
                  local_inv_freq=candle_inv_freq(local_theta, head_dim))  # MAX_SEQ_LEN 131072 rows
    types = sorted({str(t.ggml_dtype) for t in tensors.values()})
    return shape, weights, linear_quantized, {"gguf_types": types, "rope_theta": theta, "rms_norm_eps": eps,
                                              "notes": notes}


# --- the engine ----------------------------------------------------------------------------------

# A block's points leave candle once this many values are held: a long prompt's points go block
# by block (candle reuses its memory), a short one's in a few files (each file costs a write).
FLUSH_VALUES = 1 << 22


def read_f32_file(file: str) -> dict[str, torch.Tensor]:
    """The f32 tensors of a safetensors file candle wrote, as views of one buffer read at once
    (safetensors' own reader slices a storage per tensor: 30 µs each, ~500 per forward)."""
    data = np.fromfile(file, dtype=np.uint8)
    size = int(data[:8].view("<u8")[0])
    header = json.loads(data[8:8 + size].tobytes())
    header.pop("__metadata__", None)
    start = 8 + size
    if start % 4 or any(info["dtype"] != "F32" for info in header.values()):
        return load_file(file)
    flat = torch.from_numpy(data[start:].view(np.float32))
    return {name: flat[info["data_offsets"][0] // 4:info["data_offsets"][1] // 4].view(info["shape"])
            for name, info in header.items()}


@contextmanager
def candle_errors():
    """candle's own refusals (a ValueError carrying a Rust backtrace) as one line: its message."""
    try:
        yield
    except ValueError as exc:
        text = str(exc)
        said = re.search(r'Msg\("(.*?)"\)', text)
        raise TracerError(f"candle refused: {said.group(1) if said else text.split(', backtrace')[0]}") from None


class CandleEngine(EngineBase):
    entry = ENGINES["candle"]

    def __init__(self, label: str, variant: dict, shape: Shape, forward: Forward, facts: dict, gguf: bool):
        self.label, self.variant, self.shape, self.forward, self.facts = label, dict(variant), shape, forward, facts
        self.gguf = gguf
        self.vocab_size, self.max_positions, self.num_layers = shape.vocab_size, shape.max_positions, shape.num_layers

    def record(self, tokens: list[int], recorder=None, *, positions=None) -> Trace:
        """Every point of one forward. candle's tensors leave candle through its own safetensors
        writer, one file per block as soon as the block is done (a point-by-point copy through
        Python lists costs more than the forward; holding every point until the end keeps candle
        from reusing its memory), and are read back into the recorder in order."""
        self.first_position(tokens, positions)  # its tokens run from 0: other positions are refused
        recorder = recorder if recorder is not None else TraceRecorder()
        self._recorded(tokens, recorder)
        return Trace(recorder.tensors, self._meta(tokens))

    def decode(self, tokens: list[int], count: int, *, forced: list[int] | None = None, offset: int = 0) -> Trace:
        """The prefill and `count` decode steps with candle-transformers' KV cache (`Cache`: the keys
        after RoPE and the values concatenated step by step, each step's RoPE at `index_pos`), every
        step's points and what the cache holds."""
        self.first_position(tokens, at_positions(offset, len(tokens)).get("positions"))  # from 0 only
        if self.shape.file == "gemma3.rs" and any(self.shape.windows):
            # candle_nn's RotatingKvCache on gemma3.rs' sliding layers keeps their last sliding_window keys only
            raise TracerError("--decode with candle on gemma3: its sliding layers' rotating cache is not composed yet")
        cache = Cache(self.num_layers)

        def forward(ids: list[int], start: int) -> tuple[Trace, torch.Tensor]:
            recorder = TraceRecorder()
            self._recorded(ids, recorder, cache)
            return Trace(recorder.tensors, self._meta(ids, start or None)), recorder.tensors[LOGITS]  # (T, V)

        return decode_steps(forward, tokens, count, forced, offset)

    def _recorded(self, tokens: list[int], recorder, cache: Cache | None = None) -> None:
        """One forward (after what `cache` holds, if any) with every point handed to `recorder`."""
        with tempfile.TemporaryDirectory(prefix="tracer-candle-") as folder:
            files: list[tuple[str, list[str]]] = []
            kept: dict[str, object] = {}
            held = [0]  # values in `kept`

            def keep(point: str, tensor) -> None:
                rows = tensor.shape[-2] if is_causal(point) else 0
                if rows > ATTENTION_ROWS:  # (1, H, T, T): the last query rows only, as every recorder keeps
                    tensor = tensor.narrow(2, rows - ATTENTION_ROWS, ATTENTION_ROWS)
                kept[point], held[0] = tensor, held[0] + tensor.nelement
                layer, sub = split_point(point)
                if layer is not None and sub == "" and held[0] > FLUSH_VALUES:
                    flush()

            def flush() -> None:
                files.append((str(Path(folder) / f"{len(files)}.safetensors"), list(kept)))
                self.forward.candle.utils.save_safetensors(files[-1][0], kept)
                kept.clear()
                held[0] = 0

            with candle_errors():
                self.forward(tokens, keep, cache)
            flush()  # the last blocks, the final norm and the logits
            for file, points in files:
                tensors = read_f32_file(file)
                for point in points:
                    recorder(point, self._layout(point, tensors.pop(point)))

    def logits(self, tokens: list[int]) -> torch.Tensor:
        """(T, V) logits of an unrecorded forward."""
        logits = self.plain_forward(tokens)
        with tempfile.TemporaryDirectory(prefix="tracer-candle-") as folder:
            file = str(Path(folder) / "logits.safetensors")
            self.forward.candle.utils.save_safetensors(file, {"logits": logits})
            return load_file(file)["logits"][0]

    def plain_forward(self, tokens: list[int]):
        """candle's forward with nothing recorded: the (1, T, V) logits as a candle tensor (what the
        benchmark times recording against)."""
        with candle_errors():
            return self.forward(tokens, lambda name, tensor: None)

    def _layout(self, point: str, tensor: torch.Tensor) -> torch.Tensor:
        """HF layout: GGUF q/k rows back in half-split order, per head."""
        if self.shape.gguf_rows and (gguf_permuted(point) or split_point(point)[1] == CACHE_K):  # keys after RoPE
            return from_interleaved(tensor, self.shape.head_dim)  # per head of D along the last axis
        return tensor

    def _meta(self, tokens: list[int], offset: int | None = None) -> TraceMeta:
        facts = self.facts
        notes = []
        if not self.gguf and facts["reader"] == "candle" and "rope_theta" not in facts["config"] and \
                "theta" not in self.variant:
            notes.append(f"candle's config reader (LlamaConfig, candle 0.11) took rope_theta = "
                         f"{facts['rope_theta']:g}: config.json has no top-level rope_theta"
                         + (" (only rope_parameters, as transformers 5 saves it)"
                            if "rope_parameters" in facts["config"] else ""))
        notes.extend(facts.get("notes", ()))  # what a family file's Config reading noted
        notes.append(f"composed from candle's ops where 0.4.2 lacks 0.11's fused kernel ({composed_text(self.shape)})")
        if self.gguf:
            notes.append(SAME_CODE)
            k_quants = [t for t in facts["gguf_types"] if t.lower().endswith("k")]
            if k_quants:
                notes.append(K_QUANT_CAVEAT.format(types=", ".join(k_quants)))
        # gemma2.rs reads an absent final_logit_softcapping as no cap, where transformers caps at 30: its logits are
        # the uncapped ones, and the capped point transformers records does not exist here
        uncapped = {FINAL_LOGITS: f"candle's {self.shape.file} applies no final soft-cap: config.json has no "
                                  "final_logit_softcapping (transformers caps at 30)"} \
            if self.shape.file == "gemma2.rs" and self.shape.final_softcap is None else {}
        return self.meta(
            tokens, "float32", uncapped, num_layers=self.num_layers, runtime=runtime(),
            candle={"forward": self.shape.file, "composed": composed(self.shape),
                    "rope_theta": facts["rope_theta"], "rms_norm_eps": facts["rms_norm_eps"],
                    "threads": self.forward.candle.utils.get_num_threads(),
                    **({"gguf_types": facts["gguf_types"]} if self.gguf else {"config_reader": facts["reader"]})},
            notes=notes, unused_config_keys=None if self.gguf else facts.get("unused_config_keys", []),
            position_offset=offset,
        )


def load(source: ModelSource, variant: dict, *, argument: str | None = None, device="cpu",
         stream: bool = False) -> CandleEngine:
    """candle on `candle:PATH.gguf` (quantized_llama.rs), else on the model directory (llama.rs)."""
    if source.loaded:
        raise TracerError("the candle engine loads its model from files: pass a model directory or candle:PATH.gguf")
    check_platform()
    candle = import_candle(variant.get("threads"))
    if argument:
        path = Path(argument).expanduser()
        if not path.is_file():
            raise TracerError(f"GGUF file not found: {path}")
        check_gguf_header(path)
        shape, weights, linear, facts = gguf_model(path, variant, candle)
        label, gguf = str(path), True
    else:
        shape, weights, linear, facts = hf_model(source.directory, variant, candle)
        label, gguf = source.name, False
    return CandleEngine(label, variant, shape, Forward(shape, weights, linear, candle), facts, gguf)


def child_environment(variant: dict) -> dict[str, str]:
    """The isolated child's variables for `variant`: the rayon pool's size, which candle reads once per process."""
    threads = variant.get("threads")
    return {} if threads is None else {"RAYON_NUM_THREADS": str(threads)}


def import_candle(threads: int | None):
    """candle, its rayon pool sized by `threads` (RAYON_NUM_THREADS, read once when candle first
    computes); a pool already running with another size is said, not ignored."""
    if threads is not None and "candle" not in sys.modules:
        os.environ["RAYON_NUM_THREADS"] = str(threads)
    import candle  # RAYON_NUM_THREADS is read when candle loads: set first

    if threads is not None and candle.utils.get_num_threads() != threads:
        raise TracerError(f"threads={threads}: candle already runs {candle.utils.get_num_threads()} threads in this "
                          "process (its pool is sized once)")
    return candle
