"""Other runtimes' tensor names mapped onto tracer's points, in one table.

A port dumps its intermediate tensors under the names its own code uses: candle's llama.rs
field names (`blocks.3.mlp.c_proj`), the ggml graph names llama.cpp's eval callback prints
(`ffn_out-3`), TransformerLens hook names (`blocks.3.hook_mlp_out`), or HF module paths (MLX's
mlx-lm uses the same paths). `ALIASES` maps each, with `{i}` for the layer, onto the point
vocabulary (`tracer.points`); a user mapping file (JSON `{"their_name_pattern":
"our_point_pattern"}`) extends and overrides it. A name that maps nowhere is listed, never
dropped silently; names known to hold something tracer has no point for are listed with why.

Each alias also says how that runtime lays the tensor out, for `tracer.layouts`:
`layout` is the natural order of a per-head tensor ("THD": [T, H, D], "HTD": [H, T, D]) used
when the shape alone is ambiguous (T == H), and `qk_order` is "interleaved" where q/k rows are
in GGUF's order (llama.cpp's converter permutes the q/k weight rows so that RoPE pairs are
adjacent; the activations come out permuted the same way).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from tracer.errors import TracerError, one_line
from tracer.points import EMBED, FINAL_NORM, LAYER_POINTS, LOGITS

L = "model.layers.{i}"


@dataclass(frozen=True)
class Alias:
    """One runtime's name (pattern with `{i}`) for one point."""

    pattern: str
    point: str
    runtime: str
    layout: str | None = None  # "THD" or "HTD" for per-head tensors of this runtime
    qk_order: str = "half"  # "interleaved": q/k rows in GGUF order (llama.cpp)


def _table(runtime: str, rows, **defaults) -> list[Alias]:
    return [Alias(pattern, point, runtime, **{**defaults, **extra}) for pattern, point, *rest in rows
            for extra in [rest[0] if rest else {}]]


# candle-transformers models/llama.rs: Llama { wte, blocks, ln_f, lm_head }, Block { rms_1, attn, rms_2,
# mlp }, CausalSelfAttention { q_proj, k_proj, v_proj, o_proj }, Mlp { c_fc1 (gate_proj), c_fc2
# (up_proj), c_proj (down_proj) }. A module's name stands for its output; candle keeps the batch
# dimension and its forward returns the last position's logits only.
CANDLE = _table("candle", [
    ("wte", EMBED),
    ("blocks.{i}.rms_1", f"{L}.input_layernorm"),
    ("blocks.{i}.attn.q_proj", f"{L}.self_attn.q_proj"),
    ("blocks.{i}.attn.k_proj", f"{L}.self_attn.k_proj"),
    ("blocks.{i}.attn.v_proj", f"{L}.self_attn.v_proj"),
    ("blocks.{i}.attn.o_proj", f"{L}.self_attn.o_proj"),
    ("blocks.{i}.attn", f"{L}.self_attn.o_proj"),
    ("blocks.{i}.rms_2", f"{L}.post_attention_layernorm"),
    ("blocks.{i}.mlp.c_fc1", f"{L}.mlp.gate_proj"),
    ("blocks.{i}.mlp.c_fc2", f"{L}.mlp.up_proj"),
    ("blocks.{i}.mlp.c_proj", f"{L}.mlp.down_proj"),
    ("blocks.{i}.mlp", f"{L}.mlp.down_proj"),
    ("blocks.{i}", L),
    ("ln_f", FINAL_NORM),
], layout="HTD")

# llama.cpp's graph names as its eval callback prints them ("name-il"), from the llama model build
# and llama-graph.cpp's build_attn / build_ffn. ggml's ne order is reversed from numpy's: a dump
# in row-major order gives Qcur as [T, H, D], kq_soft_max as [H, T, n_kv], the rest as [T, C].
# Qcur/Kcur are reported three times per layer with the same name: after the matmul ([T, H*D]),
# reshaped (a view of it, [T, H, D]) and after RoPE ([T, H, D]); Vcur twice (matmul, reshape). A
# dump that keeps one tensor per name keeps the last, so they map to q_rope / k_rope / v_proj; a
# live graph tells the writes apart by their op (`GGML_WRITES`). In the last layer llama.cpp keeps
# only the output rows (usually the last position) from ffn_inp on; tracer compares those rows.
# The token embeddings are named `embd` in the llama.cpp of llama-cpp-python 0.3.36 (since
# llama.cpp PR 18550, `inp_embd` is the input for embeddings given directly, a graph leaf the
# callback never sees); older builds named the token embeddings `inp_embd`.
GGML = _table("ggml", [
    ("embd", EMBED),
    ("inp_embd", EMBED),
    ("attn_norm-{i}", f"{L}.input_layernorm"),
    ("Qcur-{i}", f"{L}.self_attn.q_rope", {"qk_order": "interleaved"}),
    ("Kcur-{i}", f"{L}.self_attn.k_rope", {"qk_order": "interleaved"}),
    ("Vcur-{i}", f"{L}.self_attn.v_proj"),
    ("kq_soft_max-{i}", f"{L}.self_attn.probs"),
    ("kqv_out-{i}", f"{L}.self_attn.context"),
    ("attn_out-{i}", f"{L}.self_attn.o_proj"),
    ("ffn_inp-{i}", f"{L}.resid_mid"),
    ("ffn_norm-{i}", f"{L}.post_attention_layernorm"),
    ("ffn_gate-{i}", f"{L}.mlp.gate_proj"),
    ("ffn_up-{i}", f"{L}.mlp.up_proj"),
    ("ffn_swiglu-{i}", f"{L}.mlp.act"),
    ("ffn_gate_par-{i}", f"{L}.mlp.act"),  # older llama.cpp: silu(gate), then ·up under this name
    ("ffn_out-{i}", f"{L}.mlp.down_proj"),
    ("l_out-{i}", L),
    ("result_norm", FINAL_NORM),
    ("result_output", LOGITS),
], layout="THD")

# ggml names written more than once in one llama.cpp graph: which write is which point, by the op
# that wrote it. Writes of other ops (RESHAPE: a view of the projection, same values) are not
# points. With projection biases the ADD after the matmul is the projection's output (it comes
# later and replaces the MUL_MAT write).
GGML_WRITES: dict[str, dict[str, str]] = {
    "Qcur-{i}": {"MUL_MAT": f"{L}.self_attn.q_proj", "ADD": f"{L}.self_attn.q_proj", "ROPE": f"{L}.self_attn.q_rope"},
    "Kcur-{i}": {"MUL_MAT": f"{L}.self_attn.k_proj", "ADD": f"{L}.self_attn.k_proj", "ROPE": f"{L}.self_attn.k_rope"},
    "Vcur-{i}": {"MUL_MAT": f"{L}.self_attn.v_proj", "ADD": f"{L}.self_attn.v_proj"},
}

# GGUF tensor names used for the outputs of the modules holding those weights (candle's
# quantized_llama and other GGUF ports): q/k come out in GGUF's interleaved order.
GGUF = _table("gguf", [
    ("token_embd", EMBED),
    ("blk.{i}.attn_norm", f"{L}.input_layernorm"),
    ("blk.{i}.attn_q", f"{L}.self_attn.q_proj", {"qk_order": "interleaved"}),
    ("blk.{i}.attn_k", f"{L}.self_attn.k_proj", {"qk_order": "interleaved"}),
    ("blk.{i}.attn_v", f"{L}.self_attn.v_proj"),
    ("blk.{i}.attn_output", f"{L}.self_attn.o_proj"),
    ("blk.{i}.ffn_norm", f"{L}.post_attention_layernorm"),
    ("blk.{i}.ffn_gate", f"{L}.mlp.gate_proj"),
    ("blk.{i}.ffn_up", f"{L}.mlp.up_proj"),
    ("blk.{i}.ffn_down", f"{L}.mlp.down_proj"),
    ("blk.{i}", L),
    ("output_norm", FINAL_NORM),
    ("output", LOGITS),
], layout="THD")

# TransformerLens hook names (HookedTransformer on a Llama): per-head hooks are [batch, pos,
# head, d_head]; hook_k / hook_v carry the kv heads before they are repeated; attention scores
# and pattern are [batch, head, query, key] with masked scores at -inf (excluded from metrics).
# Rotary uses the half-split pairing for Llama, as HF does.
TRANSFORMER_LENS = _table("transformer_lens", [
    ("hook_embed", EMBED),
    ("blocks.{i}.attn.hook_q", f"{L}.self_attn.q_proj"),
    ("blocks.{i}.attn.hook_k", f"{L}.self_attn.k_proj"),
    ("blocks.{i}.attn.hook_v", f"{L}.self_attn.v_proj"),
    ("blocks.{i}.attn.hook_rot_q", f"{L}.self_attn.q_rope"),
    ("blocks.{i}.attn.hook_rot_k", f"{L}.self_attn.k_rope"),
    ("blocks.{i}.attn.hook_attn_scores", f"{L}.self_attn.scores"),
    ("blocks.{i}.attn.hook_pattern", f"{L}.self_attn.probs"),
    ("blocks.{i}.attn.hook_z", f"{L}.self_attn.context"),
    ("blocks.{i}.hook_attn_out", f"{L}.self_attn.o_proj"),
    ("blocks.{i}.hook_resid_mid", f"{L}.resid_mid"),
    ("blocks.{i}.mlp.hook_pre", f"{L}.mlp.gate_proj"),
    ("blocks.{i}.mlp.hook_pre_linear", f"{L}.mlp.up_proj"),
    ("blocks.{i}.mlp.hook_post", f"{L}.mlp.act"),
    ("blocks.{i}.hook_mlp_out", f"{L}.mlp.down_proj"),
    ("blocks.{i}.hook_resid_post", L),
], layout="THD")

# HF module paths are the points themselves; these two modules' outputs are points too.
HF = _table("hf", [
    (f"{L}.self_attn", f"{L}.self_attn.o_proj"),
    (f"{L}.mlp", f"{L}.mlp.down_proj"),
    ("logits", LOGITS),
], layout="HTD")

ALIASES: list[Alias] = [*CANDLE, *GGML, *GGUF, *TRANSFORMER_LENS, *HF]

# Names other runtimes record that hold something no point holds: skipped, and said so.
NOT_COMPARABLE = {
    "kq-{i}": "llama.cpp's q·kᵀ before the 1/sqrt(head_dim) scale (tracer's scores are scaled)",
    "norm-{i}": "llama.cpp's RMS-normalized input before the norm weight",
    "ffn_silu-{i}": "llama.cpp's silu(gate) before the product with up",
    "kqv-{i}": "llama.cpp's per-head attention output before the heads are merged (use kqv_out)",
    "blocks.{i}.ln1.hook_normalized": "TransformerLens normalizes before the norm weight (fold_ln folds it into W_Q/W_K/W_V)",
    "blocks.{i}.ln2.hook_normalized": "TransformerLens normalizes before the norm weight (fold_ln folds it into W_gate/W_in)",
    "ln_final.hook_normalized": "TransformerLens normalizes before the norm weight (fold_ln folds it into W_U)",
    "blocks.{i}.ln1.hook_scale": "TransformerLens' RMS scale, one number per position",
    "blocks.{i}.ln2.hook_scale": "TransformerLens' RMS scale, one number per position",
    "ln_final.hook_scale": "TransformerLens' RMS scale, one number per position",
    "blocks.{i}.hook_resid_pre": "TransformerLens' block input: the previous block's hook_resid_post (or hook_embed)",
}

TOKEN_TENSORS = ("tokens", "input_ids")


def _compile(pattern: str) -> re.Pattern:
    return re.compile("^" + re.escape(pattern).replace(re.escape("{i}"), r"(\d+)") + "$")


_WRITES = [(_compile(pattern), ops) for pattern, ops in GGML_WRITES.items()]


def ggml_write(name: str, op: str) -> tuple[bool, str | None]:
    """For a name llama.cpp writes more than once per graph (`GGML_WRITES`): (True, the point that
    the write of `op` is, or None for a write that is no point). Any other name: (False, None).

    Example:
        >>> ggml_write("Qcur-3", "ROPE"), ggml_write("Qcur-3", "RESHAPE"), ggml_write("l_out-3", "ADD")
        ((True, 'model.layers.3.self_attn.q_rope'), (True, None), (False, None))
    """
    for regex, ops in _WRITES:
        match = regex.match(name)
        if match:
            point = ops.get(op)
            return True, point.replace("{i}", match.group(1)) if point else None
    return False, None


def is_point(name: str) -> bool:
    """A name of tracer's vocabulary (for any number of layers)."""
    if name in (EMBED, FINAL_NORM, LOGITS):
        return True
    match = re.fullmatch(r"model\.layers\.\d+(?:\.(.+))?", name)
    return match is not None and (match.group(1) or "") in LAYER_POINTS


def _is_point_pattern(pattern: str) -> bool:
    return is_point(pattern.replace("{i}", "0"))


@dataclass(frozen=True)
class Resolved:
    """Where one of their names lands: our point, and the alias that took it there."""

    name: str
    point: str
    alias: Alias


class AliasTable:
    """The built-in aliases, extended (and overridden, entries first) by a user mapping.

    Example:
        >>> table = AliasTable()
        >>> table.resolve("blocks.3.mlp.c_proj").point
        'model.layers.3.mlp.down_proj'
        >>> table.resolve("l_out-3").point
        'model.layers.3'
    """

    def __init__(self, user: dict[str, str | None] | None = None):
        user = user or {}
        self.ignored = {pattern for pattern, point in user.items() if point is None}
        # A user entry inherits the layout hints of a built-in alias with the same name pattern
        # (Qcur-{i} stays in GGUF order whatever point it is sent to).
        builtin = {a.pattern: a for a in ALIASES}
        users = [Alias(p, point, "user", builtin[p].layout if p in builtin else None,
                       builtin[p].qk_order if p in builtin else "half")
                 for p, point in user.items() if point is not None]
        self.aliases = [*users, *ALIASES]
        self._compiled = [(_compile(a.pattern), a) for a in self.aliases]
        self._skipped = [(_compile(p), reason) for p, reason in NOT_COMPARABLE.items() if p not in user]
        self._ignored = [_compile(p) for p in self.ignored]

    def resolve(self, name: str) -> Resolved | None:
        """Our point for `name`, or None when no alias matches (see `skip_reason`)."""
        for regex, alias in self._compiled:
            match = regex.match(name)
            if match:
                point = alias.point.replace("{i}", match.group(1)) if match.groups() else alias.point
                return Resolved(name, point, alias)
        if is_point(name):  # HF module paths (also MLX's mlx-lm): the points themselves
            return Resolved(name, name, Alias(name, name, "hf", "HTD"))
        return None

    def skip_reason(self, name: str) -> str | None:
        """Why a known name is not compared (None: not a known name)."""
        if any(regex.match(name) for regex in self._ignored):
            return "ignored by the aliases file"
        return next((reason for regex, reason in self._skipped if regex.match(name)), None)


def load_alias_file(path: str | Path) -> dict[str, str | None]:
    """Read a user mapping: a JSON object {"their_name_pattern": "our_point_pattern" or null}.

    `{i}` stands for the layer index on both sides; null skips the name on purpose.

    Raises:
        TracerError: unreadable file, not an object of strings, a target that is not a point,
            or `{i}` on one side only.
    """
    path = Path(path)
    try:
        mapping = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TracerError(f"cannot read aliases file {path}: {one_line(exc)}") from None
    if not isinstance(mapping, dict):
        raise TracerError(f"aliases file {path}: expected a JSON object {{\"their_name\": \"our_point\"}}")
    for theirs, ours in mapping.items():
        if ours is not None and not isinstance(ours, str):
            raise TracerError(f"aliases file {path}: {theirs!r} maps to {ours!r}; expected a point name or null")
        if ours is None:
            continue
        if not _is_point_pattern(ours):
            raise TracerError(f"aliases file {path}: {theirs!r} maps to {ours!r}, which is not a tracer point "
                              f"(e.g. model.layers.{{i}}.mlp.down_proj; see docs/trace-format.md)")
        if ("{i}" in ours) != ("{i}" in theirs):
            raise TracerError(f"aliases file {path}: {theirs!r} -> {ours!r}: use {{i}} on both sides or neither")
    return mapping


def alias_table(aliases=None) -> AliasTable:
    """An AliasTable from None, a mapping, a path to a mapping file, or an AliasTable."""
    if isinstance(aliases, AliasTable):
        return aliases
    if aliases is None:
        return AliasTable()
    if isinstance(aliases, dict):
        return AliasTable(aliases)
    return AliasTable(load_alias_file(aliases))


@dataclass
class Renamed:
    """A foreign file's tensors under our point names, with what did not make it."""

    tensors: dict  # point -> tensor, in the file's order
    sources: dict[str, dict]  # point -> {"name", "runtime", "layout", "qk_order"}
    unknown: list[str]  # names no alias matches
    skipped: dict[str, str]  # known names without a point -> why
    duplicates: dict[str, list[str]]  # point -> the other names that also mapped to it (not used)


def rename(tensors: dict, table: AliasTable) -> Renamed:
    """Map every name of a foreign file onto a point; the first name to reach a point wins."""
    out = Renamed({}, {}, [], {}, {})
    for name, tensor in tensors.items():
        resolved = table.resolve(name)
        if resolved is None:
            reason = table.skip_reason(name)
            if reason:
                out.skipped[name] = reason
            else:
                out.unknown.append(name)
            continue
        if resolved.point in out.tensors:
            out.duplicates.setdefault(resolved.point, []).append(name)
            continue
        alias = resolved.alias
        out.tensors[resolved.point] = tensor
        out.sources[resolved.point] = {"name": name, "runtime": alias.runtime, "layout": alias.layout,
                                       "qk_order": alias.qk_order}
    return out
