"""The regime knobs as strategies of `tracer.reimpl.forward`, and GGUF weights read as stored.

Knobs (defined in `tracer.model.knobs.KNOBS`, honoured by the reimpl engine):

- `weights`: q4_0 | q4_1 | q5_0 | q5_1 | q8_0 (every projection quantized by the gguf package's
  reference quantizer; embeddings and norms as loaded) or `gguf` (every tensor of a GGUF file, each
  in its own type, q/k rows un-permuted to HF order: `gguf_file`, another quantization of the same
  model, else the file the model directory was converted from; `requantize` names tensors taken
  as llama.cpp's quantizer makes them from the loaded weights instead).
- `act_quant`: none | q8_0 | q8_1 | q8_k | auto (each quantized weight's vec-dot type, as ggml).
- `act_round`: even (x86) | away (ggml's portable reference): ties of the activation rounding.
- `kv_cache`: f32 | f16 | bf16 | q8_0: the format K and V are stored in. With `ops=ggml` the
  attention is llama.cpp's flash attention (an f32 cache is cast to f16 for it, as llama.cpp does);
  with `ops=hf` it is the eager attention on stored K/V, Q converted to the K type's vec-dot type
  and (f16/bf16) the probabilities converted before the product with V, as ggml's mul_mat does.
- `ops`: hf | ggml: embedding, RMSNorm, RoPE, SwiGLU and attention as transformers or as ggml's
  CPU backend computes them (`tracer.ggml.ops`).
- `accumulate`: ggml | f32 | f64: the quantized matmuls, RoPE, SwiGLU and attention in ggml's own
  order (bit-exact on x86, compiled: `tracer.ggml.kernels`), or with the matmuls through torch's BLAS in
  f32 (another valid order, fast) or f64 (exact) and the rest exact in f64, rounded once (see
  `tracer.pipeline.noise_floor.regime_noise`).
- `flash_attn`: on | auto | off: with ops=ggml, llama.cpp's flash attention (auto is on for its
  CPU backend) or its unfused attention, which records scores and probabilities; with ops=hf the
  attention is unfused anyway (off, auto) and `on` is refused.
- `preset=llamacpp`: ops=ggml, act_quant=auto, kv_cache=f16, accumulate=ggml, act_round=even;
  add `weights=gguf` for a model converted from a GGUF.

A regime is a variant dict, e.g. {"preset": "llamacpp", "weights": "gguf"}, which the reimpl
engine runs like any other (`tracer.record(..., engine="reimpl", variant=...)`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from tracer.core.errors import TracerError
from tracer.files.gguffile import GGUFFile
from tracer.files.sources import DEFAULT_GGUF, bundled_gguf
from tracer.ggml import candle, ops, repack, tinyblas
from tracer.ggml.candle import apply_ops
from tracer.ggml.floats import F32, ROUND, round_bf16, round_f16
from tracer.ggml.kmatmul import emulated as kquants_emulated
from tracer.ggml.kquants import KQUANT_TYPES, from_gguf_bytes
from tracer.ggml.quantizer import ggml_quantizer
from tracer.ggml.quants import (
    ACT_BLOCK,
    BLOCK_TYPES,
    VEC_DOT_TYPE,
    Blocks,
    quantize,
    quantize_activations,
    quantize_q8_0,
)
from tracer.ggml.vecdot import has_kernel, matmul_blas, matmul_ggml
from tracer.model.component import family_named, registered
from tracer.model.knobs import PRESETS, ggml_graph, is_regime, llama_gguf, setting
from tracer.model.points import (
    DOWN_PROJ,
    EMBED,
    GATE_PROJ,
    K_PROJ,
    LOGITS,
    O_PROJ,
    PROBS,
    Q_PROJ,
    SCORES,
    UP_PROJ,
    V_PROJ,
    WEIGHT,
    gguf_permuted,
)
from tracer.names.gguf import gguf_family, gguf_tensor_name, hf_tensor_name
from tracer.traces.layouts import from_interleaved, to_interleaved

PROJECTIONS = (Q_PROJ, K_PROJ, V_PROJ, O_PROJ, GATE_PROJ, UP_PROJ, DOWN_PROJ)


# --- weights ----------------------------------------------------------------------------------

# llama.cpp architectures whose graph scales Q before attention (ggml_scale by f_attention_scale) and
# soft-caps inside the flash attention where its config caps: Gemma 2's and 3's.
Q_SCALED_ARCHS = ("gemma2", "gemma3")
OFFSET_NORM_ARCHS = ("gemma2", "gemma3")  # the converter stores their norm weights as 1 + w


def permuted(name: str, family: str = "llama") -> bool:
    """A q/k weight whose rows the family's GGUF holds in RoPE-pair order: llama.cpp's converter permutes
    them for its "llama" architecture only (Llama, Mistral); Qwen's and Gemma's rotate NEOX-style, rows
    as in the model."""
    return (family_named(family).gguf_arch == "llama" and name.endswith(WEIGHT)
            and gguf_permuted(name.removesuffix(WEIGHT)))


def gguf_path(source: dict | None) -> Path:
    """The GGUF file a converted model directory came from (its config's `tracer_source`).

    Raises:
        TracerError: the directory was not converted from a GGUF, or the file is gone.
    """
    name = (source or {}).get("gguf_file")
    if not name:
        raise TracerError("weights=gguf needs a model converted from a GGUF file (its config.json has no "
                          "tracer_source.gguf_file): pass --model FILE.gguf, or name the file, gguf_file=PATH")
    path = bundled_gguf() if name == DEFAULT_GGUF else Path(name)
    if not path.is_file():
        raise TracerError(f"weights=gguf: the GGUF file this model was converted from is gone: {path}")
    return path


def _unpermute_rows(rows: int, head_dim: int) -> torch.Tensor:
    """Index taking GGUF-ordered q/k weight rows to HF order (`tracer.traces.layouts.from_interleaved`)."""
    return from_interleaved(torch.arange(rows)[None], head_dim)[0]


class GGUFWeights(Mapping):
    """HF name -> `Blocks` (every matrix, f32/f16/bf16 ones included: ggml's mul_mat picks its
    kernels by the type) or an f32 tensor (norm vectors), read from a GGUF file as stored:
    llama.cpp's own numbers, named for the family its architecture is (`general.architecture`).
    Permuted q/k weights get their rows put back in HF order."""

    def __init__(self, path: Path):
        self.file = GGUFFile(path)
        family = gguf_family(self.file.fields.get("general.architecture"))
        self.family = family.name if family else "llama"
        self.names = {name: info for info in self.file.tensors.values()
                      if (name := hf_tensor_name(info.name, self.family))}
        self.head_dim = _head_dim(self.file)
        self.cache: dict[str, object] = {}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: info.shape for name, info in self.names.items()}

    def types(self) -> dict[str, str]:
        """HF name -> GGUF type name ("q4_1", "f32", ...)."""
        return {name: info.kind for name, info in self.names.items()}

    def __getitem__(self, name: str):
        if name not in self.cache:
            self.cache[name] = self.decode(name, self.file.raw(self.names[name].name))
        return self.cache[name]

    def decode(self, name: str, raw: np.ndarray):
        """Tensor `name` from its GGUF bytes `raw` ((rows, bytes per row) uint8, the file's row order)."""
        info = self.names[name]
        if info.kind in ("f32", "f16", "bf16"):
            dtype = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}[info.kind]
            values = torch.from_numpy(np.ascontiguousarray(raw).view(dtype).reshape(info.shape).copy())
            blocks = values.view(torch.bfloat16).to(F32) if info.kind == "bf16" else values.to(F32)
            if blocks.ndim == 2:  # a matrix keeps its type: ggml's mul_mat picks its kernels by it
                blocks = Blocks(info.kind, info.shape, held=blocks)
        else:
            blocks = from_gguf_bytes(info.kind, raw, info.shape)
        if permuted(name, self.family):
            order = _unpermute_rows(info.shape[0], self.head_dim)
            blocks = blocks.rows(order) if isinstance(blocks, Blocks) else blocks[order]
        return blocks

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


class RequantizedWeights(Mapping):
    """A GGUF's weights with some tensors replaced by llama.cpp's quantization of the reference's
    own, in the file's type (`requantize=`: what the audit puts in place of a damaged tensor)."""

    def __init__(self, weights: GGUFWeights, reference: Mapping, tensors: tuple[str, ...]):
        self.weights, self.reference, self.quantizer = weights, reference, ggml_quantizer()
        by_gguf = {info.name.removesuffix(".weight"): name for name, info in weights.names.items()}
        unknown = [tensor for tensor in tensors if tensor.removesuffix(".weight") not in by_gguf]
        if unknown:
            raise TracerError(f"requantize={'+'.join(tensors)}: {weights.file.path.name} has no tensor "
                              f"{unknown[0]}")
        if self.quantizer is None:
            raise TracerError("requantize= takes llama.cpp's own quantizer, which is not installed (llama-cpp-python)")
        self.replaced = {by_gguf[tensor.removesuffix(".weight")] for tensor in tensors}
        self.cache: dict[str, object] = {}

    def __getitem__(self, name: str):
        if name not in self.replaced:
            return self.weights[name]
        if name not in self.cache:
            info = self.weights.names[name]
            values = reference_tensor(self.reference, name, self.weights.family).to(F32)
            values = values.reshape(info.shape[0], -1)  # (R, C)
            order = gguf_rows(self.weights, name, info.shape[0])
            rows = values if order is None else values[torch.from_numpy(order)]
            self.cache[name] = self.weights.decode(name, self.quantizer.quantize(info.kind, rows.numpy()))
        return self.cache[name]

    def shapes(self):
        return self.weights.shapes()

    def types(self):
        return self.weights.types()

    def __iter__(self):
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)


def reference_tensor(reference: Mapping, name: str, family: str = "llama") -> torch.Tensor:
    """A model's tensor for an HF name, as llama.cpp's converter stores it: the output layer of tied
    embeddings is the embedding; a Gemma's norm weights are stored as 1 + w (added in f32)."""
    if name == LOGITS + WEIGHT and name not in reference:
        name = EMBED + WEIGHT
    if family_named(family).gguf_arch in OFFSET_NORM_ARCHS and name.endswith("norm.weight"):
        return reference[name].to(F32) + 1
    return reference[name]


def gguf_rows(weights: GGUFWeights, name: str, rows: int) -> np.ndarray | None:
    """Index of a model's rows in a GGUF's order (q/k rows are permuted there), or None: same order."""
    if not permuted(name, weights.family):
        return None
    return to_interleaved(torch.arange(rows)[None], weights.head_dim)[0].numpy()


def check_same_model(weights: GGUFWeights, reference: Mapping, path: Path) -> None:
    """A GGUF of this very model: every weight the reference has (an output layer tied to the
    embedding aside) is in the file with the same shape.

    Raises:
        TracerError: in one line, naming the first tensor that differs or is missing, and both shapes.
    """
    shapes = reference.shapes() if hasattr(reference, "shapes") else {n: tuple(t.shape) for n, t in reference.items()}
    for name, info in weights.names.items():
        mine = shapes.get(name, shapes.get(EMBED + WEIGHT) if name == LOGITS + WEIGHT else None)
        if mine is None:
            raise TracerError(f"{path.name} is not a file of this model: it has {info.name}, the model has no "
                              f"{name}")
        if tuple(mine) != tuple(info.shape):
            raise TracerError(f"{path.name} is not a file of this model: its {info.name} is {tuple(info.shape)}, "
                              f"the model's {name} is {tuple(mine)}")
    missing = [name for name in shapes
               if name not in weights.names and name != LOGITS + WEIGHT and gguf_tensor_name(name, weights.family)]
    if missing:
        raise TracerError(f"{path.name} is not a file of this model: it has no "
                          f"{gguf_tensor_name(missing[0], weights.family)} for the "
                          f"model's {missing[0]}")


def _head_dim(file) -> int:
    arch = file.fields["general.architecture"]
    rope_dims = file.number(f"{arch}.rope.dimension_count")
    if rope_dims:
        return int(rope_dims)
    return int(file.number(f"{arch}.embedding_length")) // int(file.number(f"{arch}.attention.head_count"))


# source tensor -> {kind: its Blocks}: the variants of one sweep or diagnosis that share a weight
# format (weights=q4_1 with and without act_quant, preset=candle-q,weights=q4_1) quantize it once,
# and the blocks go when the weights read for them do.
_QUANTIZED = WeakIdKeyDictionary()


class QuantizedWeights(Mapping):
    """The loaded weights with every projection quantized to `kind` on first access (cached with
    the tensor it was quantized from)."""

    def __init__(self, weights: Mapping, kind: str):
        self.weights, self.kind, self.cache = weights, kind, {}

    def __getitem__(self, name: str):
        if not name.endswith(tuple(p + ".weight" for p in PROJECTIONS)):
            return self.weights[name]
        if name not in self.cache:
            source = self.weights[name]
            formats = _QUANTIZED.setdefault(source, {})
            if self.kind not in formats:
                formats[self.kind] = quantize(source.to(F32), self.kind)
            self.cache[name] = formats[self.kind]
        return self.cache[name]

    def shapes(self):
        return self.weights.shapes() if hasattr(self.weights, "shapes") else \
            {name: tuple(t.shape) for name, t in self.weights.items()}

    def __iter__(self):
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)


def weight_format(kind: str | None, gguf_file: str | None = None, requantize: str | None = None):
    """The `weights` strategy: (loaded weights, the config's tracer_source) -> weights to run.

    weights=gguf takes every tensor of a GGUF in its own type: `gguf_file` (another quantization of
    this model, checked to be one: same names and shapes), else the file the directory was converted
    from; `requantize` names tensors ("blk.5.attn_k+...") taken as llama.cpp's quantizer makes them
    from the loaded weights instead, in the file's type."""
    if kind is None:
        return lambda weights, source: weights
    if kind != "gguf":
        return lambda weights, source: QuantizedWeights(weights, kind)

    def from_gguf(weights, source):
        path = Path(gguf_file) if gguf_file else gguf_path(source)
        if gguf_file and not path.is_file():
            raise TracerError(f"gguf_file={gguf_file}: no such file")
        stored = GGUFWeights(path)
        if gguf_file:
            check_same_model(stored, weights, path)
        return RequantizedWeights(stored, weights, tuple(requantize.split("+"))) if requantize else stored

    return from_gguf


# --- matmuls ----------------------------------------------------------------------------------


def _weight_kind(weight) -> str:
    if isinstance(weight, Blocks):
        return weight.kind
    return "f32"


def act_kind(weight, act_quant: str) -> str:
    """The format activations take before a matmul with `weight`: `act_quant`, or with `auto` the
    weight type's ggml vec-dot type (f32 weights: none)."""
    if act_quant != "auto":
        return act_quant
    kind = VEC_DOT_TYPE.get(_weight_kind(weight), "f32")
    return "none" if kind == "f32" else kind


def make_linear(act_quant: str, rounding: str, accumulate: str):
    """The `linear` strategy: x (1, T, C) @ weight (R, C)ᵀ + bias -> (1, T, R), the activations in
    the regime's format and the products accumulated as `accumulate` says: ggml's own order where
    its kernel is emulated (else f64), or BLAS in f32 / f64; `act_round=candle` and
    `accumulate=candle` take candle's quantizer and vec_dot kernels (`tracer.ggml.candle`).
    ggml's order is the kernel llama.cpp's build takes for the weight: `vec_dot` (`tracer.ggml.vecdot`),
    Q4_0/IQ4_NL repacked at load or not (`tracer.ggml.repack`), a GGUF's f32/f16/bf16 matrix by
    tinyBLAS or `ggml_vec_dot_*` (`tracer.ggml.tinyblas`)."""
    blas_dtype = F32 if accumulate == "f32" else torch.float64  # ggml: f64 where no kernel is emulated
    quantize, candle_matmul = quantize_activations, None
    if "candle" in (rounding, accumulate):
        quantize = candle.quantize if rounding == "candle" else quantize_activations
        candle_matmul = candle.matmul if accumulate == "candle" else None
    last: dict = {}  # the input quantized last: q/k/v (and gate/up) take the same tensor object in turn

    def quantized_input(x: torch.Tensor, kind: str):
        """x's activation blocks, quantized once for consecutive projections of the same x (the
        forward never writes a tensor in place once it has been passed on)."""
        if last.get("x") is not x or last.get("kind") != kind:
            last.update(x=x, kind=kind, act=quantize(x[0].to(F32), kind, rounding))
        return last["act"]

    def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.device.type != "cpu":
            raise TracerError(f"the regime knobs emulate ggml's CPU arithmetic in CPU code: run them with --device cpu "
                              f"(got {x.device.type})")
        rows = x[0].to(F32)  # (T, C)
        kind = act_kind(weight, act_quant)
        if candle_matmul is not None and kind in ("f16", "bf16"):
            kind = "none"  # candle dequantizes f16 weights and multiplies f32 activations
        if kind in ACT_BLOCK:
            act = quantized_input(x, kind)
            exact_order = accumulate == "ggml" and isinstance(weight, Blocks) and has_kernel(weight, act)
            if candle_matmul is not None and isinstance(weight, Blocks):
                out = candle_matmul(act, weight)
            elif accumulate == "ggml" and repack.emulates(weight, act):  # Q4_0/IQ4_NL: repacked or not
                out = repack.matmul(act, weight)
            else:
                out = matmul_ggml(act, weight) if exact_order else matmul_blas(act, weight, blas_dtype)
        elif kind in ("f16", "bf16"):
            converted = ROUND[kind](rows)  # mul_mat's conversion to the weight's vec-dot type
            out = tinyblas.matmul(converted, weight) if accumulate == "ggml" else matmul_blas(converted, weight,
                                                                                               blas_dtype)
        elif candle_matmul is not None:  # candle: an F32/F16 weight dequantized, multiplied by gemm
            out = candle_matmul(rows, weight)
        elif accumulate == "ggml" and isinstance(weight, Blocks) and weight.kind == "f32":
            out = tinyblas.matmul(rows, weight)  # a GGUF's f32 matrix: tinyBLAS' f32 kernel or ggml_vec_dot_f32
        elif isinstance(weight, Blocks) or accumulate != "ggml":
            out = matmul_blas(rows, weight, blas_dtype)
        else:
            out = F.linear(rows, weight)
        out = out if bias is None else out + bias.to(F32)
        return out[None].to(x.device)

    return linear


def dequantized_embed(embed):
    """The family's `embed` step on the dequantized table, as ggml_get_rows reads a quantized
    token_embd (Q8_0's f32(d) * q is exact)."""

    def dequantized(ids: torch.Tensor, weight, spec) -> torch.Tensor:
        table = weight.values() if isinstance(weight, Blocks) else weight
        return embed(ids, table.to(F32), spec)

    return dequantized


# --- attention --------------------------------------------------------------------------------


def _round_q8_0(x: torch.Tensor, rounding: str) -> torch.Tensor:
    """(..., D) quantized to Q8_0 blocks of 32 along D and dequantized."""
    shape = x.shape
    if shape[-1] % 32:
        raise TracerError(f"kv_cache=q8_0 stores heads in 32-value blocks; this model's head_dim is {shape[-1]}")
    return quantize_q8_0(x.reshape(-1, shape[-1]), rounding).values().reshape(shape)


def kv_rounding(kv_cache: str, rounding: str):
    """The function storing a (…, D) K or V (GGUF order for K) in the cache format, back as f32."""
    table = {"f32": lambda x: x.to(F32), "f16": round_f16, "bf16": round_bf16,
             "q8_0": lambda x: _round_q8_0(x, rounding)}
    return table[kv_cache]




def gguf_dims(family: str):
    """(…, D) HF order -> the order llama.cpp holds a head's dims in, which its dot products and
    cache blocks run along: RoPE pairs adjacent for its "llama" architecture (the converter permuted
    the q/k rows), HF's own order for the NEOX families (Qwen, Gemma, Phi-3, OLMo-2)."""
    return to_interleaved if family_named(family).gguf_arch == "llama" else _same_dims


def _same_dims(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    return x


def make_attention_ggml(kv_cache: str, accumulate: str, rounding: str, order=to_interleaved):
    """llama.cpp's CPU flash attention. f16 (and f32, which llama.cpp casts to f16 for it): both of
    its paths. bf16 and q8_0: the one-chunk path with an f32 accumulator, Q in the cache's vec-dot
    type; a quantized cache is Hadamard-rotated as llama.cpp rotates it (Q and K before RoPE'd
    rows are stored, V too, the output back). Other accumulations: the same operands, summed in
    f64."""

    def attention(q, k, v, spec, steps, record, visible=None):
        q, scale = _scaled_queries(q, spec)
        if kv_cache in ("f16", "f32"):
            allowed = None if visible is None else ~visible.blocked()  # (T, S): keys by their positions
            return ops.flash_attention(q, k, v, spec.head_dim, accumulate, allowed, order, scale,
                                       spec.attn_logit_softcapping)
        if scale is not None or spec.attn_logit_softcapping:
            raise TracerError(f"the ggml regime's kv_cache={kv_cache} attention has no Gemma 2 scaling or soft-capping")
        heads, dim = q.shape[1], spec.head_dim
        q_g = order(q[0].to(F32), dim)  # (H, T, D) llama.cpp's order
        k_g = order(k[0].to(F32), dim)  # (KV, T, D)
        v_kv = v[0].to(F32)  # (KV, T, D)
        quantized = kv_cache == "q8_0"
        rot_k, rot_v = (ops.rotation_size(dim, True), ops.rotation_size(dim, False)) if quantized else (None, None)
        if rot_k:
            q_g, k_g = ops.fwht(q_g, rot_k), ops.fwht(k_g, rot_k)
        if rot_v:
            v_kv = ops.fwht(v_kv, rot_v)
        store = kv_rounding(kv_cache, rounding)
        values = ops.kv_for_heads(store(v_kv), heads)  # (H, T, D): v_to_float of the cache
        scale = np.float32(ops.attention_scale(dim))
        if accumulate == "ggml":
            scores = _cache_scores(q_g, k_g, kv_cache, rounding) * scale  # (H, T, T)
            out = ops.flash_attn_one_chunk_f32(scores, values)
        else:
            keys = ops.kv_for_heads(store(k_g), heads)
            out = ops.flash_attn_exact(store(q_g), keys, values, float(scale), round_q=False)
        return (ops.fwht(out, rot_v) if rot_v else out)[None]

    attention.fused = "llama.cpp's flash attention never forms the scores and probabilities"
    attention.cached = True  # rows after a KV cache: the queries are the last keys (tracer.ggml.ops.causal)
    return attention


def _scaled_queries(q: torch.Tensor, spec):
    """Gemma 2's graph scales Q by f_attention_scale (ggml_scale, f32) before attention, whose kq_scale
    is then 1.0: (Q scaled, 1.0) there, else (Q, None: the kernel's 1/sqrt(head_dim)). The scale is
    the config's query_pre_attn_scalar^-0.5 in f32, as llama.cpp's 1.0f/sqrtf(head_dim) where the two
    agree (llama.cpp reads no query_pre_attn_scalar: where they differ, so do the models)."""
    if family_named(spec.family).gguf_arch not in Q_SCALED_ARCHS:
        return q, None
    scale = np.float32(1.0) / np.sqrt(np.float32(spec.score_scale_dim))
    return q.to(F32) * scale, 1.0


def _cache_scores(q: torch.Tensor, k: torch.Tensor, kv_cache: str, rounding: str) -> torch.Tensor:
    """q (H, T, D), k (KV, T, D) GGUF order -> (H, T, T) q·k as the K type's vec_dot computes them:
    Q8_0 (Q quantized by quantize_row_q8_0, ggml_vec_dot_q8_0_q8_0) or bf16 (ggml_vec_dot_bf16)."""
    groups = q.shape[0] // k.shape[0]
    if kv_cache == "bf16":
        keys = ops.kv_for_heads(round_bf16(k), q.shape[0])
        return ops.vec_dot_bf16(round_bf16(q)[:, :, None, :], keys[:, None, :, :])
    rows = []
    for head in range(q.shape[0]):
        stored = quantize_q8_0(k[head // groups], rounding)  # (T, B, 32): cpy_k's blocks
        keys = Blocks("q8_0", (k.shape[1], k.shape[2]), d=stored.d, q=stored.q)
        rows.append(matmul_ggml(quantize_q8_0(q[head], rounding), keys))  # (T, T)
    return torch.stack(rows)


def make_attention_unfused(kv_cache: str, order=to_interleaved):
    """llama.cpp's attention with flash attention off (`tracer.ggml.ops.attention_unfused`)."""
    if kv_cache == "q8_0":
        raise TracerError("kv_cache=q8_0 needs flash attention (llama.cpp: a quantized V cache requires flash_attn)")

    def attention(q, k, v, spec, steps, record, visible=None):
        if family_named(spec.family).gguf_arch in Q_SCALED_ARCHS:
            raise TracerError("the ggml regime's attention without flash attention has no Gemma 2 scaling or "
                              "soft-capping: flash_attn=on")
        return ops.attention_unfused(q, k, v, spec.head_dim, kv_cache, record, order)

    attention.cached = True
    return attention


def make_attention_stored(kv_cache: str, rounding: str, order=to_interleaved):
    """Eager attention on K and V stored in `kv_cache` (transformers' op order otherwise): Q goes to
    K's vec-dot type, and for f16/bf16 the probabilities to V's type before the product, as ggml's
    non-flash mul_mat path converts its second operand."""
    store = kv_rounding(kv_cache, rounding)
    probs_format = ROUND.get(kv_cache, lambda x: x)

    def attention(q, k, v, spec, steps, record, visible=None):
        groups = spec.num_kv_groups
        qs = _stored_qk(q, store, spec.head_dim, order)  # (1, H, T, D)
        ks = steps.repeat_kv(_stored_qk(k, store, spec.head_dim, order), groups)  # (1, H, T, D)
        vs = steps.repeat_kv(store(v.to(F32)), groups)  # (1, H, T, D)
        scores = steps.scale_scores(torch.matmul(qs, ks.transpose(2, 3)), spec.score_scale_dim)  # (1, H, T, T)
        scores = steps.softcap(scores, spec.attn_logit_softcapping)
        record(SCORES, scores)
        probs = torch.softmax(steps.mask(scores, visible), dim=-1, dtype=F32)
        record(PROBS, probs)
        return torch.matmul(probs_format(probs), vs)

    attention.cached = True  # the mask from the keys' positions (`visible`)
    return attention


def _stored_qk(x: torch.Tensor, store, head_dim: int, order=to_interleaved) -> torch.Tensor:
    """Q or K (1, heads, T, D) in the cache format, blocks taken in llama.cpp's dim order."""
    if order is _same_dims:
        return store(x.to(F32))
    return from_interleaved(store(to_interleaved(x.to(F32), head_dim)), head_dim)


# --- the other ops ----------------------------------------------------------------------------


def glu_ggml(accumulate: str):
    swiglu = ops.SWIGLU[accumulate]

    def glu(gate: torch.Tensor, up: torch.Tensor, hidden_act: str) -> torch.Tensor:
        if hidden_act == "gelu_pytorch_tanh":  # Gemma's GeGLU: ggml_geglu_split, its f16 table
            return ops.geglu(gate, up)
        if hidden_act != "silu":
            raise TracerError(f"ops=ggml emulates SwiGLU and Gemma's GeGLU only (hidden_act {hidden_act!r})")
        return swiglu(gate, up)

    return glu


# --- assembling -------------------------------------------------------------------------------


def check_knobs(knobs: dict) -> None:
    if not is_regime(knobs):
        return
    for knob in ("gguf_file", "requantize"):
        if knob in knobs and knobs.get("weights") != "gguf":
            raise TracerError(f"{knob}= says which GGUF tensors weights=gguf takes: it needs weights=gguf")
    if setting(knobs, "dtype") != "f32":
        raise TracerError(f"dtype={knobs['dtype']} cannot combine with regime knobs: they emulate f32 arithmetic "
                          "(the regime's noise floor is tracer.pipeline.noise_floor.regime_noise)")
    if knobs.get("ops") in ("ggml", "candle") and setting(knobs, "attn") != "eager":
        raise TracerError(f"ops={knobs['ops']} brings its runtime's own attention; it does not combine with attn=sdpa")
    if knobs.get("ops") == "candle" and knobs.get("kv_cache", "f32") != "f32":
        raise TracerError("ops=candle is candle's attention on f32 K/V (quantized_llama.rs keeps no other cache type)")
    if knobs.get("flash_attn") == "on" and knobs.get("ops") != "ggml":
        raise TracerError("flash_attn=on is llama.cpp's flash attention: on the reimpl engine it needs ops=ggml "
                          "(preset=llamacpp); with ops=hf attention is unfused")


def _names(applies) -> str:
    return ", ".join(name for name, row in registered().items() if applies(row))


def rope_ggml(family: str):
    """llama.cpp's RoPE mode for the family's architecture: normal (pairs adjacent in the GGUF's rows)
    for its "llama" architecture, NEOX for the others the regime emulates."""
    return ops.rope if family_named(family).gguf_arch == "llama" else ops.rope_neox


def apply_regime(knobs: dict, strategies, spec=None):
    """`strategies` (the forward's `tracer.model.component.Steps`) with the regime knobs' steps put in. The number
    formats (weights, act_quant, kv_cache, accumulate) apply to every family; ggml's own ops
    (ops=ggml, preset=llamacpp) are emulated for llama.cpp's graphs of the families of `ggml_graph`."""
    check_knobs(knobs)
    if not is_regime(knobs):
        return strategies
    family = spec.family if spec is not None else "llama"
    if knobs.get("ops") == "candle" and family != "llama":
        raise TracerError(f"ops=candle emulates candle's Llama forward; this model is a {family} "
                          "(the number-format knobs weights/act_quant/kv_cache apply to it)")
    if knobs.get("ops") == "ggml" and not ggml_graph(family_named(family)):
        raise TracerError(f"ops=ggml emulates llama.cpp's graph of {_names(ggml_graph)} only; this model is a "
                          f"{family}")
    if knobs.get("weights") == "gguf" and not llama_gguf(family_named(family)):  # GGUFWeights' names and rows
        raise TracerError(f"weights=gguf reads the GGUFs of {_names(llama_gguf)}; this model is a {family}")
    if knobs.get("ops") == "ggml" and family_named(family).gguf_arch in Q_SCALED_ARCHS and \
            knobs.get("weights") != "gguf":  # ggml's norm multiplies by the stored weight, 1 + w in a GGUF
        raise TracerError(f"ops=ggml on a {family} takes a GGUF's own tensors (its norms hold 1 + w): add weights=gguf")
    rounding, accumulate = setting(knobs, "act_round"), setting(knobs, "accumulate")
    linear = make_linear(setting(knobs, "act_quant"), rounding, accumulate)
    changes = {"weights": weight_format(knobs.get("weights"), knobs.get("gguf_file"), knobs.get("requantize")),
               "linear": linear,
               "logits": functools.partial(strategies.logits, linear=linear),
               "embed": dequantized_embed(strategies.embed)}
    kv_cache = knobs.get("kv_cache")
    if knobs.get("ops") == "ggml":
        changes |= {"norm": ops.rms_norm,
                    "rope": rope_ggml(family) if accumulate == "ggml" else ops.rope_exact,
                    "rotary": ops.rope_cos_sin, "glu": glu_ggml(accumulate), "softcap": ops.softcap_logits,
                    "attention": make_attention_ggml(kv_cache or "f32", accumulate, rounding, gguf_dims(family))}
        if setting(knobs, "flash_attn") == "off":
            changes["attention"] = make_attention_unfused(kv_cache or "f32", gguf_dims(family))
    elif kv_cache is not None:
        changes["attention"] = make_attention_stored(kv_cache, rounding, gguf_dims(family))
    if kv_cache in ("f16", "bf16"):  # a decode's cache holds K and V as llama.cpp stores them (its cache points)
        changes["cache_store"] = kv_rounding(kv_cache, rounding)
    replaced = strategies.replace(**changes)
    if knobs.get("ops") == "candle":  # candle's f32 kernels (tracer.ggml.candle)
        return apply_ops(replaced)
    return replaced


def regime_catalogue() -> list[str]:
    """Regimes `tracer diagnose` tries: each block type with and without its activation
    quantization, KV caches, the 16-bit load dtypes, and candle's quantized arithmetic on the GGUF
    the model was converted from (or on Q4_1 weights quantized here)."""
    variants = []
    for kind in BLOCK_TYPES:
        variants += [f"weights={kind},act_quant={VEC_DOT_TYPE[kind]}", f"weights={kind}"]
    return variants + ["kv_cache=f16", "kv_cache=q8_0", "dtype=bf16", "dtype=f16",
                       "preset=candle-q,weights=gguf", "preset=candle-q,weights=q4_1"]


# --- the regime a llama.cpp run implies ---------------------------------------------------------

# Weight types whose llama.cpp CPU kernels (x86 AVX2/AVX-512 build) are emulated in their own order,
# on every path the build takes: Q4_0/IQ4_NL repacked at load or not (`tracer.ggml.repack`), f32/f16/
# bf16 by tinyBLAS or ggml_vec_dot (`tracer.ggml.tinyblas`), the others by their vec_dot kernel.
EXACT_WEIGHT_TYPES = {"f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl"}
# Tensors no matmul takes (norms, biases: f32 whatever the file type, and exact in any order).
NOT_MULTIPLIED = ("norm.weight", ".bias")
# The k-quants are, on a build that runs the x86 AVX2 code (every path: `tracer.ggml.kmatmul`).
KQUANT_WEIGHT_TYPES = set(KQUANT_TYPES)
KQUANT_NOT_EXACT = ("this llama.cpp build lacks AVX2 or FMA: its k-quant kernels (the AVX, ARM or scalar ones) "
                    "are not the x86 AVX2 ones emulated; summed in the x86 order instead")
# The code paths emulated (a GGML_NATIVE build): AVX2's with FMA and F16C, and AVX-512F/DQ's beside them, the
# build's feature report saying which (`ops.f32_lanes`, `ops.avx512_exp`).
CPU_FLAGS = ("avx2", "fma", "f16c")
# How the caveats that name this CPU's or build's own code paths begin (`emulates_this_cpu`): the ops tracer
# emulates then run other arithmetic in llama.cpp, not only the kernels a caveat on a weight type names.
CPU_PATH_CAVEATS = ("this CPU lacks ", "this llama.cpp build accumulates ", "this llama.cpp build multiplies ")
# A native build on a CPU with AMX multiplies these weight types in its AMX buffer (ggml-cpu/amx; f16
# too: amx.cpp's supports_op): not emulated.
AMX_WEIGHT_TYPES = {"f16", "q4_0", "q4_1", "q8_0", "q4_k", "q5_k", "q6_k", "iq4_xs"}


def implied_regime(weight_types: Mapping[str, str], llamacpp_variant: Mapping[str, str] | None = None,
                   flags: set[str] | None = None, build: frozenset[str] | None = None,
                   head_dim: int | None = None) -> tuple[dict, list[str]]:
    """The reimpl variant that reproduces a llama.cpp CPU run, and what of it is not bit-exact here.

    Args:
        weight_types: tensor name -> GGUF type of the model file (`GGUFWeights.types()`).
        llamacpp_variant: the llamacpp engine's knobs (`kv_cache`, `flash_attn`; llama.cpp's
            defaults f16 and auto, which is on for the CPU backend).
        flags: CPU feature flags (default: this machine's).
        build: the features the llama.cpp build reports (default: `ops.llamacpp_cpu_features()`).
        head_dim: the model's head size (GGUFWeights.head_dim), where known: from 128 an
            AVX512-FP16 build accumulates flash attention's f16 values in FP16 arithmetic.

    Returns:
        (variant, caveats): e.g. ({"preset": "llamacpp", "weights": "gguf"}, []). With no caveat the
        free-running comparison is expected to be exactly 0 at every point (with kv_cache=q8_0 but
        for llama.cpp's `kqv_out`, which it records Hadamard-rotated); with caveats compare per op
        (`ReimplEngine.op_trace` fed the llama.cpp trace), against the per-op floor
        (`tracer.pipeline.regime_view.per_op_noise`). Norms and biases, which no matmul takes, are not weights
        here: an f32 matrix is (llamafile's sgemm).

    Example:
        >>> from tracer.files.sources import bundled_gguf
        >>> implied_regime(GGUFWeights(bundled_gguf()).types(), {"kv_cache": "f16"}, flags=set(CPU_FLAGS))
        ({'preset': 'llamacpp', 'weights': 'gguf'}, [])
        >>> implied_regime(GGUFWeights(bundled_gguf()).types(), {"kv_cache": "q8_0"},
        ...                flags={"avx2"})[1]  # doctest: +NORMALIZE_WHITESPACE
        ['this CPU lacks fma, f16c: llama.cpp takes other code paths here (exp, f16 dot products,
          lane orders) than the AVX2/AVX-512 ones emulated']
    """
    knobs = dict(llamacpp_variant or {})
    variant = {"preset": "llamacpp", "weights": "gguf"}
    kv_cache = knobs.get("kv_cache", PRESETS["llamacpp"]["kv_cache"])  # llama.cpp's own default cache
    if kv_cache != "f16":
        variant["kv_cache"] = kv_cache
    if setting(knobs, "flash_attn") == "off":
        variant["flash_attn"] = "off"
    build = ops.llamacpp_cpu_features() if build is None else build
    exact = EXACT_WEIGHT_TYPES | (KQUANT_WEIGHT_TYPES if kquants_emulated(build) else set())
    caveats = []
    matrices = {name: kind for name, kind in weight_types.items() if not name.endswith(NOT_MULTIPLIED)}
    for kind in sorted(set(matrices.values()) - exact):
        names = [name for name, t in matrices.items() if t == kind]
        why = KQUANT_NOT_EXACT if kind in KQUANT_WEIGHT_TYPES else "no emulated kernel; accumulated in f64"
        caveats.append(f"{kind.upper()} weights ({len(names)} tensors, e.g. {names[0]}): {why}")
    flags = ops.cpu_flags() if flags is None else flags
    missing = [flag for flag in CPU_FLAGS if flag not in flags]
    if "avx512f" in flags and "avx512dq" not in flags:  # ggml_v_expf's AVX-512 variant needs both: AVX2's then
        missing.append("avx512dq")
    if missing:
        caveats.append(f"{CPU_PATH_CAVEATS[0]}{', '.join(missing)}: llama.cpp takes other code paths here "
                       "(exp, f16 dot products, lane orders) than the AVX2/AVX-512 ones emulated")
    fp16 = ops.native_f16_columns(head_dim or 0, build)
    if fp16 and kv_cache == "f16" and variant.get("flash_attn") != "off":
        caveats.append(f"{CPU_PATH_CAVEATS[1]}flash attention's values in AVX512-FP16 arithmetic "
                       f"({fp16} of {head_dim} columns): emulated from the instructions' definition, not yet "
                       "measured against llama.cpp")
    amx = sorted(set(weight_types.values()) & AMX_WEIGHT_TYPES)
    if amx and "AMX_INT8" in build:
        caveats.append(f"{CPU_PATH_CAVEATS[2]}{', '.join(t.upper() for t in amx)} weights in AMX "
                       "tiles (AMX_INT8), which are not emulated: build llama-cpp-python without AMX "
                       "(docs/engine-llamacpp.md)")
    return variant, caveats


def emulates_this_cpu(caveats: Sequence[str]) -> bool:
    """Whether the ops tracer emulates in ggml's order are llama.cpp's own arithmetic here: no caveat of
    `implied_regime` names this CPU's or this build's code paths (another exp, other lanes, AMX tiles)."""
    return not any(caveat.startswith(CPU_PATH_CAVEATS) for caveat in caveats)
