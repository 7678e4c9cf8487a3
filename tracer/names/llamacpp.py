"""llama.cpp's names: the ggml graph node names its eval callback sees (`cb(cur, "Qcur", il)` gives
"Qcur-3"), which a dump of that callback keeps. ggml's ne order reversed from numpy's gives per-head
tensors as [T, H, D]. A name written more than once in one graph is told apart by the op that wrote it
(`ggml_write`): `Qcur-3` is the matmul (q_proj, `ADD` where there is a bias), a reshape that is a view of it
(no point) and the RoPE (q_rope, in GGUF's interleaved order: llama.cpp's converter permutes the q/k
weight rows)."""

from __future__ import annotations

from tracer.model.component import family_named
from tracer.model.component import registered as families
from tracer.model.points import (
    BLOCK_OUT,
    CONTEXT,
    DOWN_PROJ,
    EMBED,
    FINAL_NORM,
    GATE_PROJ,
    INPUT_NORM,
    K_PROJ,
    K_ROPE,
    LOGITS,
    MLP_ACT,
    O_PROJ,
    POST_ATTENTION_NORM,
    PROBS,
    Q_PROJ,
    Q_ROPE,
    RESID_MID,
    UP_PROJ,
    V_PROJ,
)
from tracer.names.vocabulary import Name, Vocabulary, pattern_regex, per_family, register

PROJECTION = ("MUL_MAT", "ADD")  # the matmul, and the bias added to it

GGML = register(Vocabulary(
    "ggml", "llama.cpp's graph node names", "THD",
    names={
        EMBED: ("embd", "inp_embd"),  # older builds: inp_embd
        INPUT_NORM: ("attn_norm-{i}",),
        Q_PROJ: (Name("Qcur-{i}", writes=PROJECTION, dump=False),),
        K_PROJ: (Name("Kcur-{i}", writes=PROJECTION, dump=False),),
        V_PROJ: (Name("Vcur-{i}", writes=PROJECTION),),
        Q_ROPE: (Name("Qcur-{i}", qk_order="interleaved", writes=("ROPE",)),),
        K_ROPE: (Name("Kcur-{i}", qk_order="interleaved", writes=("ROPE",)),),
        PROBS: ("kq_soft_max-{i}",),
        CONTEXT: ("kqv_out-{i}",),
        O_PROJ: ("attn_out-{i}",),
        RESID_MID: ("ffn_inp-{i}",),
        POST_ATTENTION_NORM: ("ffn_norm-{i}",),
        GATE_PROJ: ("ffn_gate-{i}",),
        UP_PROJ: ("ffn_up-{i}",),
        MLP_ACT: ("ffn_swiglu-{i}", "ffn_gate_par-{i}"),  # older builds wrote silu(gate)·up as ffn_gate_par
        DOWN_PROJ: ("ffn_out-{i}",),
        BLOCK_OUT: ("l_out-{i}",),
        FINAL_NORM: ("result_norm",),
        LOGITS: ("result_output",),
    },
    skipped={
        "kq-{i}": "llama.cpp's q·kᵀ before the 1/sqrt(head_dim) scale (tracer's scores are scaled)",
        "norm-{i}": "llama.cpp's RMS-normalized input before the norm weight",
        "ffn_silu-{i}": "llama.cpp's silu(gate) before the product with up",
        "kqv-{i}": "llama.cpp's per-head attention output before the heads are merged (use kqv_out)",
    },
))


def ggml_writes(family: str | None = None) -> dict[str, dict[str, str]]:
    """ggml names written more than once in one llama.cpp graph: which write is which point, by the op
    that wrote it (Qcur-{i}: MUL_MAT and ADD (a bias) are q_proj, ROPE is q_rope), in `family`'s graph
    (None: every registered family's, the first one's where they differ). Writes of other ops (RESHAPE: a
    view of the projection, same values) are not points."""
    writes: dict[str, dict[str, str]] = {}
    for row in [family_named(family)] if family else families().values():
        for point, names in GGML.patterns(row).items():
            for name in names:
                for op in name.writes:
                    writes.setdefault(name.pattern, {}).setdefault(op, point)
    return writes


_WRITES: dict = {}  # family -> [(regex, op -> point)]: compiled once per state of the registries


def ggml_write(name: str, op: str, family: str | None = None) -> tuple[bool, str | None]:
    """For a name llama.cpp writes more than once per graph (`ggml_writes`): (True, the point that
    the write of `op` is, or None for a write that is no point). Any other name: (False, None).

    Example:
        >>> ggml_write("Qcur-3", "ROPE"), ggml_write("Qcur-3", "RESHAPE"), ggml_write("l_out-3", "ADD")
        ((True, 'model.layers.3.self_attn.q_rope'), (True, None), (False, None))
    """
    compiled = per_family(_WRITES, family, lambda: [(pattern_regex(pattern), ops)
                                                    for pattern, ops in ggml_writes(family).items()])
    for regex, ops in compiled:
        match = regex.match(name)
        if match:
            point = ops.get(op)
            return True, point.replace("{i}", match.group(1)) if point else None
    return False, None
