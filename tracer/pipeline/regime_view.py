"""Comparing a candidate in the number-format regime its runtime implies (`tracer run --regime`).

A quantized or 16-bit port differs from f32 transformers by design: llama.cpp quantizes its
activations to 8 bits inside each quantized matmul, MLX in bf16 rounds every op. Against f32 such a
port "diverges" at the first projection, correct or not. The regime view compares it instead with
tracer's own model run in the same number formats (`tracer.ggml.strategies`'s knobs, or a 16-bit
dtype): there a correct port matches and a bug stands alone. Three things are reported beside the
regime's verdict:

- the raw view: the same candidate against the f32 reference (what the verdict would be without
  the regime), with its first divergence;
- the regime's own cost: per point, the rel_l2 of the regime reference against the f32 one (what
  a user of the quantized model pays, and where);
- per op: the regime's ops rerun on the candidate's own inputs (`ReimplEngine.op_trace`), each
  point then carries its op's error only, which stays small where a free-running emulation's tiny
  differences would flip 8-bit roundings downstream. Where the emulation cannot be bit-exact
  (another CPU, a kernel not emulated, a long prompt), this view gives the verdict
  (`verdict_view`), against `per_op_noise`.

A regime on a GGUF's own tensors (the candidate's file, `gguf_file=`) audits them first against the
model's own weights (`tracer.ggml.audit`): the audit rides along as `RegimeView.audit`, and a tensor
found damaged is taken requantized from the model's weights (`requantize=`).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from tracer.comparison.diff import ErrorRecorder, rel_l2_by_point
from tracer.comparison.result import NOISE_FACTOR, RawView, RegimeView, Result
from tracer.core.errors import TracerError
from tracer.engines.load import load_engine
from tracer.engines.registry import EngineRef, check_engine
from tracer.files.hashes import stats
from tracer.files.sources import ModelSource, check_gguf_header
from tracer.files.weights import WeightFiles
from tracer.ggml.audit import WeightAudit, audit_gguf
from tracer.ggml.quantizer import ggml_quantizer, quantizer_name
from tracer.model.knobs import expand_presets, parse_variant, setting, variant_label, variant_text
from tracer.pipeline import reference_cache
from tracer.pipeline.decode import compare_decoded
from tracer.pipeline.request import Inputs, Placement, Request, Side
from tracer.pipeline.run import compare_candidate, prepared_reference, timed
from tracer.traces.trace import Trace

# Prompts up to this long are emulated bit-exactly in a chaotic regime (`verdict_view`): verified
# against llama.cpp on SmolLM2 at 2048 tokens. Past it, memory rather than time: the emulated flash
# attention holds its scores and weights whole, ~10 f32 (H, T, T) arrays at the peak (1.5 GB for
# SmolLM2's 9 heads at 2048 tokens, 24 GB at 8192), and the per-op view is the verdict.
EXACT_TOKENS = 2048
# With flash_attn=off the unfused attention's tinyBLAS emulation broadcasts (H, T, T, 16) products
# in tensor code (2.4 GB a temporary at 2048 tokens): its limit stays lower.
EXACT_TOKENS_UNFUSED = 512
# candle's emulation (tracer.ggml.candle, its loops compiled) is exact only within the gemm crate's
# 512-value k blocks (probs·v sums over the keys): verified against candle on SmolLM2 at 512 tokens.
EXACT_TOKENS_CANDLE = 512
# Above this, an op's error on the candidate's own inputs is more than the emulation's own spread:
# in f32 arithmetic (ggml's formats) 1e-4 (measured: 4e-5 worst with another summation order, at the
# f16 accumulator of flash attention); in a 16-bit dtype ten unit roundoffs of that dtype (one op
# rounds its result once, but two runtimes may round an op's intermediate steps differently).
PER_OP_BOUNDS = {"f32": 1e-4, "bf16": 10 * 2.0**-9, "f16": 10 * 2.0**-12}
# A cached decode in llama.cpp's regime is emulated while its one-row flash attention reads fewer than
# 512 cells (`ggml_compute_forward_flash_attn_ext_f16`: from 512, use_split_kv_path splits the keys
# among the threads and merges their partial sums, not emulated); llama.cpp pads the cells it reads
# to 256, so the prompt and the decoded tokens must fit in 256.
DECODE_CELLS = 256


def resolve(regime, candidate: EngineRef, variant: dict,
            source: ModelSource) -> tuple[dict, list[str], WeightAudit | None]:
    """The reimpl variant of the regime, its caveats and the audit of the GGUF it takes tensors from:
    `"auto"` asks the candidate's runtime and model file (`implied`); anything else is read as knobs,
    e.g. "weights=q4_1,act_quant=q8_1".

    A regime on a GGUF's own tensors (weights=gguf) audits them first (`audit_weights`); `"auto"`
    then takes each damaged tensor requantized from the reference's weights (`requantize=`), so that
    the fault shows at its op instead of being repeated by the reference."""
    if regime == "auto":
        knobs, caveats = implied(candidate, variant, source)
    else:
        knobs, caveats = parse_variant(regime), []
        if not knobs:
            raise TracerError("--regime needs 'auto' or knobs, e.g. --regime weights=q4_1,act_quant=q8_1")
    check_engine(knobs, "reimpl")
    audit = audit_weights(knobs, source) if knobs.get("weights") == "gguf" else None
    if regime == "auto" and audit is not None and audit.damaged:
        knobs = {**knobs, "requantize": "+".join(name.removesuffix(".weight") for name in audit.damaged)}
    return knobs, caveats, audit


def audit_weights(knobs: dict, source: ModelSource) -> WeightAudit:
    """The GGUF a weights=gguf regime takes (gguf_file=, else the one the directory was converted
    from) audited against the model's own weights (`tracer.ggml.audit`)."""
    from tracer.ggml.strategies import gguf_path  # numba, for ggml's kernels, loads in 0.3 s: a regime's only

    path = Path(knobs["gguf_file"]) if knobs.get("gguf_file") else gguf_path(source.config().get("tracer_source"))
    check_gguf_header(path)
    if source.loaded:  # weights in memory, which no cache key can name
        return audit_gguf(path, dict(source.module.state_dict()))
    return cached_audit(path, source.directory)


def cached_audit(path: Path, model_dir: Path) -> WeightAudit:
    """The audit of the GGUF at `path` against `model_dir`'s weights, kept in the reference cache: keyed by
    both files' stats (any write moves a ctime), llama.cpp's quantizer and tracer's code. An audit reads
    every tensor of both and requantizes the file's (39.7 s for a Llama-3.2-1B-shape Q4_K_M here), the
    same on every run of a porting session."""
    quantizer = ggml_quantizer()
    if quantizer is None:
        return audit_gguf(path, WeightFiles(model_dir))  # "not_audited", saying why
    where = path.resolve()
    key = reference_cache.entry_key(model_dir, [], measure="gguf audit", gguf=str(where),
                                    gguf_file=stats(where.parent, [where.name]), quantizer=quantizer_name(quantizer))
    kept = reference_cache.load(key)
    if kept is not None:
        try:
            return dataclasses.replace(WeightAudit.from_dict(kept["audit"]), cached=True)
        except (KeyError, TypeError, AttributeError):  # unreadable: audited again, and replaced
            pass
    audit = audit_gguf(path, WeightFiles(model_dir), quantizer)
    reference_cache.store((key, {"audit": audit.to_dict()}))
    return audit


def implied(candidate: EngineRef, variant: dict, source: ModelSource) -> tuple[dict, list[str]]:
    """The regime a candidate implies: its runtime's arithmetic on its GGUF's tensor types (the
    entry's `regime`: llama.cpp's, candle's on candle:PATH.gguf); for any engine run in a 16-bit dtype
    or with regime knobs of its own, those.

    Raises:
        TracerError: the candidate runs f32 with no number format of its own (nothing to imply).
    """
    entry = candidate.entry
    if candidate.regime is not None:
        from tracer.engines.llamacpp import gguf_of  # its ctypes structures take 0.1 s: a llama.cpp candidate's
        from tracer.ggml.strategies import GGUFWeights  # numba, for ggml's kernels, loads in 0.3 s: a regime's only

        path = gguf_of(source, candidate.argument)
        regime = runtime_regime(candidate.regime, GGUFWeights(path), variant)
        knobs, caveats = file_weights(source, path, *regime)
        if "n_ubatch" in variant:  # the regime runs the prompt whole: its kernels are chosen for T rows
            caveats = [*caveats, f"llama.cpp computes the prompt in micro-batches of {variant['n_ubatch']} tokens "
                                 "(n_ubatch), each with the kernels of its own shape; the regime runs it whole"]
        return knobs, caveats
    formats = {knob: value for knob, value in variant.items() if knob in entry.emulated}
    dtype = setting(variant, "dtype")
    if dtype != "f32":
        formats["dtype"] = dtype
    if formats:  # the candidate's own number formats (a reimpl candidate in a regime: that regime)
        return formats, []
    raise TracerError(f"--regime auto: the {candidate} candidate{' with ' + variant_text(variant) if variant else ''} "
                      "runs f32 and implies no number-format regime; name one, e.g. --regime "
                      "weights=q4_1,act_quant=q8_1")


def runtime_regime(regime: str, weights, variant: dict) -> tuple[dict, list[str]]:
    """The knobs and caveats of a runtime's regime (`EngineEntry.regime`) on a GGUF's tensors
    (`tracer.ggml.strategies.GGUFWeights`: their types, the head size): "ggml", llama.cpp's CPU
    arithmetic (`tracer.ggml.strategies.implied_regime`); "candle", candle's (`preset=candle-q`,
    `tracer.ggml.candle.implied_regime`)."""
    if regime == "ggml":
        from tracer.ggml.strategies import implied_regime  # numba, for ggml's kernels: a regime's only

        return implied_regime(weights.types(), variant, head_dim=weights.head_dim)
    if regime == "candle":
        from tracer.ggml.candle import implied_regime  # numba, for candle's kernels: a regime's only

        return implied_regime(weights.types(), str(weights.file.fields.get("general.architecture", "llama")))
    raise ValueError(f"no regime {regime!r} (an engine entry's regime is ggml, candle or None)")


def file_weights(source: ModelSource, path: Path, knobs: dict, caveats: list[str]) -> tuple[dict, list[str]]:
    """weights=gguf on the candidate's own file, each tensor in its own type, whatever directory the
    model came from: `gguf_file=` names the file unless the directory was converted from it."""
    from tracer.ggml.strategies import gguf_path  # numba, for ggml's kernels, loads in 0.3 s: a regime's only

    try:
        converted_from = gguf_path(source.config().get("tracer_source"))
    except TracerError:
        converted_from = None
    if converted_from is None or not os.path.samefile(converted_from, path):
        knobs = {**knobs, "gguf_file": str(Path(path).resolve())}
    return knobs, caveats


def regime_cost(f32_reference: Trace, regime_reference: Trace) -> dict[str, float]:
    """Per point, the rel_l2 the regime itself adds over f32: what running in it costs, and where."""
    return rel_l2_by_point(f32_reference, regime_reference)


def raw_view(raw: Result) -> RawView:
    """What the f32 comparison says, for the regime view's report."""
    return RawView(raw.verdict, raw.reference, raw.first_divergence, raw.logits)


def regime_context(knobs: dict, caveats: list[str], raw: Result, cost: dict[str, float],
                   per_op: dict[str, float] | None, view_kind: str, audit: WeightAudit | None = None) -> RegimeView:
    """The `Result.regime` record: which regime, its caveats, the raw view, its cost, the per-op view,
    how the verdict was judged (`verdict_view`) and the audit of the GGUF it took tensors from."""
    worst_op = max(per_op.items(), key=lambda item: item[1]) if per_op else None
    bound = PER_OP_BOUNDS.get(setting(knobs, "dtype"))  # None for f64: no bound
    return RegimeView(
        variant=knobs, label=variant_label(knobs), caveats=tuple(caveats), raw=raw_view(raw), cost=cost,
        per_op=per_op, per_op_worst=worst_op and {"point": worst_op[0], "rel_l2": worst_op[1]},
        per_op_bound=bound,
        per_op_over=tuple(point for point, error in (per_op or {}).items() if bound is not None and error > bound),
        verdict_view=view_kind, audit=audit, floor_at_bound=view_kind == "per_op" and floor_at_bound(knobs, caveats),
    )


def verdict_view(knobs: dict, caveats: list[str], num_tokens: int) -> str:
    """How the regime view judges the candidate: "free" (free-running, every point against the
    regime reference) or "per_op" (every op on the candidate's own inputs).

    A regime that rounds activations to 8 bits (act_quant, a q8_0 KV cache) is chaotic: an
    emulation 1e-7 off flips a rounding and parts from the candidate by 1e-2 a layer later. There,
    free-running is a verdict only where the emulation is bit-exact: ggml's own summation order
    (accumulate=ggml), on this CPU and these weight types (no caveat), and on prompts up to
    EXACT_TOKENS (about 2-3× a plain forward with the compiled loops of `tracer.ggml.kernels`;
    EXACT_TOKENS_UNFUSED with flash_attn=off); otherwise the per-op view decides. It decides too
    where a caveat names this CPU's own code paths (`floor_at_bound`), chaotic or not: free-running, those
    paths' differences add up across layers, and no floor measured here covers them.
    """
    if floor_at_bound(knobs, caveats):
        return "per_op"
    expanded = expand_presets(knobs)
    chaotic = setting(expanded, "act_quant") != "none" or expanded.get("kv_cache") == "q8_0"
    exact = not caveats and exact_order(expanded, num_tokens)
    return "free" if not chaotic or exact else "per_op"


def exact_order(knobs: dict, num_tokens: int) -> bool:
    """Whether the regime sums in its runtime's own order (accumulate=ggml or candle) on a prompt
    short enough for that emulation (EXACT_TOKENS and its kin: memory, not time, sets them)."""
    expanded = expand_presets(knobs)
    accumulate = setting(expanded, "accumulate")
    limit = (EXACT_TOKENS_CANDLE if accumulate == "candle"
             else EXACT_TOKENS_UNFUSED if expanded.get("flash_attn") == "off" else EXACT_TOKENS)
    return accumulate in ("ggml", "candle") and num_tokens <= limit


def order_spread(prepared, knobs: dict) -> dict[str, float]:
    """Per point, what another valid summation order changes in each op alone: the regime summed
    by torch's BLAS in f32 (accumulate=f32), every op fed the regime reference's values of its
    inputs, against that reference. The per-op floor of an op whose kernel is not emulated: the
    reference sums it exactly (f64), the runtime in its own f32 order."""
    engine = load_engine(EngineRef.named("reimpl"), {**knobs, "accumulate": "f32"},
                         dataclasses.replace(prepared.target, stream=False))
    errors = ErrorRecorder(prepared.trace)
    engine.op_trace(prepared.trace, errors)
    return errors.rel_l2


def per_op_noise(prepared, knobs: dict, caveats: list[str] = ()) -> dict[str, float] | None:
    """The per-op view's noise floor: per point, the larger of the regime's own (its f64 sums
    against its order, `tracer.pipeline.noise_floor.regime_noise`) and `order_spread`. Measured on SmolLM2's
    Q4_K_M at 5 tokens: without the second, 4 of 30 flash-attention outputs of a correct file read
    over their floor (llama.cpp's f16 accumulator rounds differently once its q·k sums take another
    order, rel_l2 up to 5.7e-5 against floors of 4e-6).

    Where a caveat names this CPU's or build's own code paths (`strategies.emulates_this_cpu`), even
    the ops emulated in ggml's order are not llama.cpp's arithmetic here: every point's floor is then
    at least the per-op bound over NOISE_FACTOR, so that its threshold is the bound (PER_OP_BOUNDS).
    Measured on an AVX2-only AMD EPYC (Zen 3) against the AVX-512 arithmetic emulated, SmolLM2 Q4_1 at
    5 tokens: 1.7e-5 at flash attention's outputs (another exp, 8 lanes), 4e-8 at SwiGLU, against
    floors of 6e-7 before (a correct file read DIVERGED)."""
    if prepared.noise is None:
        return None
    expanded = expand_presets(knobs)
    floor = PER_OP_BOUNDS[setting(expanded, "dtype")] / NOISE_FACTOR if floor_at_bound(knobs, caveats) else 0.0
    if setting(expanded, "accumulate") == "f32":  # summed by torch in f32 already: its noise is that spread
        return {point: max(noise, floor) for point, noise in prepared.noise.items()}
    spread = order_spread(prepared, knobs)
    return {point: max(noise, spread.get(point, 0.0), floor) for point, noise in prepared.noise.items()}


def floor_at_bound(knobs: dict, caveats: list[str]) -> bool:
    """Whether the per-op view judges every point against at least the per-op bound: a caveat names this
    CPU's or build's own code paths (`strategies.emulates_this_cpu`) and the regime has a bound."""
    from tracer.ggml.strategies import emulates_this_cpu  # numba, for ggml's kernels: a regime's only

    return PER_OP_BOUNDS.get(setting(expand_presets(knobs), "dtype")) is not None and not emulates_this_cpu(caveats)


def check_regime_decode(knobs: dict, caveats: list[str], num_tokens: int, decode: int) -> None:
    """`--decode` in a regime is compared free-running, step by step, against tracer's model decoding
    with its own cache in the regime: refused in one line where that is not a verdict (a chaotic
    regime judged per op) or not emulated (llama.cpp's split flash attention past DECODE_CELLS)."""
    if not decode:
        return
    if verdict_view(knobs, caveats, num_tokens + decode) != "free":
        raise TracerError(f"--decode with --regime {variant_text(knobs)}: the regime is judged per op here "
                          f"({'; '.join(caveats) or 'not in its runtime summation order'}), and decode steps only "
                          "free-running; run them apart")
    expanded = expand_presets(knobs)
    flash = expanded.get("ops") == "ggml" and setting(expanded, "flash_attn") != "off"
    if flash and num_tokens + decode > DECODE_CELLS:
        raise TracerError(f"--decode {decode} after {num_tokens} tokens with --regime: past {DECODE_CELLS} cells "
                          "llama.cpp's one-token flash attention splits the cache among its threads, which the "
                          "regime does not emulate; decode fewer steps")


def compare_in_regime(raw: Result, prepared, engine, knobs: dict, caveats: list[str],
                      audit: WeightAudit | None = None) -> Result:
    """The candidate against tracer's model run in the regime `knobs`, on the tokens `prepared`
    (the f32 reference's) holds: the regime view's `Result`, with the raw view `raw`, the regime's
    cost per point, the per-op errors and the weights' `audit` attached (`Result.regime`). Its noise
    floor and decode steps are the run's (`prepared.request`).

    Where `verdict_view` says "per_op", the ops whose kernels are emulated keep their runtime's
    order (exactly 0 on a correct candidate) and the others sum in f64, judged against
    `per_op_noise`; a prompt too long for the runtime's order sums with torch's BLAS in f32
    instead (accumulate=f32, ~1.4× a plain forward). The regime reference decodes no greedy
    continuation: the raw view's continuations, f32 reference against the candidate, are kept.
    Decode steps: tracer's model decodes them greedily with its own cache in the regime, the
    candidate with its own, teacher-forced on those tokens (`tracer.pipeline.decode.compare_decoded`).
    """
    noise_floor, decode = prepared.request.noise_floor, prepared.request.inputs.decode
    check_regime_decode(knobs, caveats, len(prepared.ids), decode)
    view_kind = verdict_view(knobs, caveats, len(prepared.ids))
    if view_kind == "per_op" and "accumulate" not in knobs and not exact_order(knobs, len(prepared.ids)):
        knobs = {**knobs, "accumulate": "f32"}
    target = prepared.target
    # on the f32 run's resolved target: its model, device and streaming (the cache key's placement too)
    request = Request(Inputs(target.source, tokens=prepared.ids, position_offset=prepared.position_offset),
                      Placement(str(target.device), target.stream), Side(EngineRef.named("reimpl"), knobs),
                      tolerance=prepared.tolerance, greedy=0, noise_floor=noise_floor, progress=False, target=target)
    with prepared_reference(request) as in_regime:
        timings: dict[str, float] = {}
        with timed(timings, "regime_candidate_s"):
            candidate = engine.record(in_regime.ids, in_regime.sink("candidate"))
        with timed(timings, "regime_per_op_s"):
            forced = in_regime.engine.op_trace(candidate)
        per_op = rel_l2_by_point(candidate, forced)
        if view_kind == "free":
            judged = in_regime
        else:
            with timed(timings, "regime_order_spread_s"):
                noise = per_op_noise(in_regime, knobs, caveats)
                judged = dataclasses.replace(in_regime, trace=forced, noise=noise,
                                             floor=in_regime.floor and in_regime.floor.judged_against(noise))
        view = compare_candidate(judged, engine, trace=candidate)
        if decode:
            view = compare_decoded(view, in_regime, engine, decode)
        cost = regime_cost(prepared.trace, in_regime.trace)
    timings |= {f"regime_{name}": seconds for name, seconds in view.timings.items() if name != "candidate_s"}
    # the view, the raw verdict and the caveats: reports word them from `Result.regime`; what the request
    # says of its inputs and placement (default ids, streaming) holds for both views
    notes = list(prepared.request.notes) if prepared.request is not None else []
    if raw.greedy:
        notes.append("greedy continuations: the f32 reference's against the candidate's (the regime decodes none)")
    return view.with_context(
        notes=tuple(notes), prompt=raw.prompt, chat=raw.chat, token_texts=raw.token_texts, greedy=raw.greedy,
        environment=raw.environment, command=raw.command, config_audit=raw.config_audit,
        timings={**raw.timings, **timings},
        regime=regime_context(knobs, caveats, raw, cost, per_op, view_kind, audit),
    )
