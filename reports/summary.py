"""Reading a result summary: the dict `Result.to_dict()` returns (and summary.json holds).

Every renderer (figures, HTML, Markdown) takes this dict and nothing else, so a report can be
rebuilt later from a saved summary.json. The helpers here only select and phrase what the
summary already says; the numbers themselves are never recomputed.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping
from pathlib import Path, PurePath
from typing import Any

from tracer.model.knobs import variant_text
from tracer.model.points import FINAL_LOGITS, LOGITS, split_point

Summary = dict[str, Any]

# Point fields in the order they are shown and written to points.csv.
POINT_FIELDS = (
    "point", "layer", "shape", "recorded", "missing_on",
    "max_abs", "max_ref", "rel_l2", "cosine", "diverged",
)

DASH = "—"


def as_summary(result: Any) -> Summary:
    """The summary dict of a `Result` (anything with `.to_dict()`) or of a dict itself."""
    if hasattr(result, "to_dict"):
        result = result.to_dict()
    if not isinstance(result, Mapping):
        raise TypeError(f"expected a Result or its dict, got {type(result).__name__}")
    return dict(result)


def breakdowns(summary: Summary) -> dict[str, list]:
    """The first divergence's breakdowns the result carries: {"by_position": [...], "by_head": [...]}."""
    first = summary.get("first_divergence") or {}
    return {key: list(first[key]) for key in ("by_position", "by_head") if first.get(key)}


FIGURES = ("curve.png", "heatmap.png", "breakdown.png", "routing.png")  # a report's figures, in its order


def figure_names(summary: Summary) -> tuple[str, ...]:
    """The figures a report of `summary` has: the breakdown only where the first divergence carries one, the
    routing map only where the traces carried routing points."""
    has = {"breakdown.png": bool(breakdowns(summary)), "routing.png": bool(summary.get("routing"))}
    return tuple(name for name in FIGURES if has.get(name, True))


def points(summary: Summary) -> list[dict]:
    return list(summary.get("points") or [])


def number(x) -> float | None:
    """A metric as a float. JSON has no inf/NaN, so results carry those as the strings "inf", "nan"."""
    if x is None:
        return None
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def fmt(x) -> str:
    """A measured number the one way every report shows it (terminal, Markdown, HTML, figure labels):
    three significant digits, "0.0805", "4.12e-07", "22500" (no exponent from 1e-3 to 1e5); an exact
    zero prints as 0, a missing value as —, inf and NaN as such. summary.json and points.csv keep
    full precision."""
    x = number(x)
    if x is None:
        return DASH
    if x == 0 or not math.isfinite(x):
        return "0" if x == 0 else str(x)
    if 1e3 <= abs(x) < 1e5:  # .3g would write 2.25e+04 for the 22500 of a massive activation
        return str(int(round(x, 2 - math.floor(math.log10(abs(x))))))
    return format(x, ".3g")


def percent(fraction) -> str:
    """A share as a whole percent that never rounds a disagreement away: 0.996 is "99%", not "100%"."""
    x = number(fraction)
    if x is None or math.isnan(x):
        return DASH
    shown = round(100 * x)
    if x < 1 and shown == 100:
        shown = 99
    elif x > 0 and shown == 0:
        return "<1%"
    return f"{shown}%"


def model_name(summary: Summary) -> str:
    """A short model name for titles: the last component of the model path, without .gguf."""
    model = str(summary.get("model") or "?")
    name = PurePath(model.rstrip("/\\")).name or model
    return name.removesuffix(".gguf")


def side_label(side: Mapping | None) -> str:
    side = side or {}
    return str(side.get("label") or side.get("engine") or "?")


def runtime_text(side: Mapping | None) -> str | None:
    """"llama.cpp 0.3.36": a non-PyTorch runtime's name and version, as a side records them (a
    live engine writes {"name", "version"}; a foreign dump's metadata names its runtime in text)."""
    runtime = (side or {}).get("runtime")
    if not runtime or isinstance(runtime, str):
        return runtime or None
    return " ".join(str(runtime[k]) for k in ("name", "version") if runtime.get(k))


def short_prompt(summary: Summary, limit: int = 48) -> str | None:
    prompt = summary.get("prompt")
    if prompt is None:
        return None
    prompt = " ".join(str(prompt).split())  # newlines would break a one-line title
    return prompt if len(prompt) <= limit else prompt[: limit - 1] + "…"


def input_label(summary: Summary, limit: int = 48) -> str:
    """What the run was fed: "'The capital of France is' (5 tokens)", "token ids 1,17,5 (3 tokens)"
    when ids were given, "batch of 2 rows (5, 1 tokens)" for a batch (each row, not the first alone)."""
    rows = summary.get("batch") or []
    if len(rows) > 1:
        return f"batch of {len(rows)} rows ({', '.join(str(len(row['tokens'])) for row in rows)} tokens)"
    tokens = summary.get("tokens") or []
    count = f"{len(tokens)} token" + ("" if len(tokens) == 1 else "s")
    prompt = short_prompt(summary, limit)
    if prompt is not None:
        return f"'{prompt}'{' through the chat template' if summary.get('chat') else ''} ({count})"
    ids = ",".join(map(str, tokens))
    return f"token ids {ids if len(ids) <= limit else ids[:limit - 3] + '...'} ({count})" if tokens else count


def comparison_title(summary: Summary) -> str:
    """"hf vs reimpl[theta=10000] — smollm2-135m — 'The capital of France is' (5 tokens)"."""
    sides = f"{side_label(summary.get('reference'))} vs {side_label(summary.get('candidate'))}"
    return f"{sides} — {model_name(summary)} — {input_label(summary)}"


def noise_floor_text(summary: Summary) -> str | None:
    """How the noise floor was measured, and for a match the point closest to its bound (None: no floor)."""
    floor = summary.get("floor")
    if not floor:
        return None
    closest = floor.get("closest")
    near = f"; closest to its bound: {closest['point']} at {closest['share']:.2f} of it" \
        if closest and summary.get("verdict") == "match" else ""
    return f"{floor.get('text')}{near}"


def tolerance_text(summary: Summary) -> str:
    tol = summary.get("tolerance") or {}
    return str(tol.get("text") or tol.get("criterion") or "?")


def rel_l2_threshold(summary: Summary) -> float | None:
    """The one rel_l2 tolerance every point was judged by (else None: elementwise criterion, or
    each point judged against its own noise-derived bound, `points[].threshold`)."""
    tol = summary.get("tolerance") or {}
    if tol.get("criterion") != "rel_l2":
        return None
    bounds = {number(p.get("threshold")) for p in points(summary) if p.get("threshold") is not None}
    if bounds - {number(tol.get("rel_l2"))}:
        return None
    return tol.get("rel_l2")


def missing_text(point: Mapping) -> str:
    side = point.get("missing_on")
    text = {"both": "not recorded on both sides", "neither": "not compared", None: "not recorded"}.get(
        side, f"not recorded on {side}")
    return f"{text} ({point['reason']})" if point.get("reason") else text


def worst_point(summary: Summary) -> dict | None:
    """The recorded point with the largest rel_l2 (for the 'all agree' sentence)."""
    recorded = [p for p in points(summary) if number(p.get("rel_l2")) is not None]
    # a NaN would compare false against everything; rank it above every finite error
    return max(recorded, key=lambda p: _rank(number(p["rel_l2"])), default=None)


def _rank(x: float) -> float:
    return math.inf if math.isnan(x) else x


def verdict_sentence(summary: Summary) -> str:
    """One plain-text sentence saying what the verdict means for this run."""
    verdict = summary.get("verdict")
    if verdict == "error":
        return f"The run failed: {summary.get('error') or 'no message'}"
    nonfinite = nonfinite_text(summary.get("first_nonfinite"))
    if verdict == "diverged" and summary.get("first_divergence"):
        return divergence_sentence(summary["first_divergence"]) + (f". {nonfinite}" if nonfinite else "")
    return match_sentence(summary)


def nonfinite_text(nonfinite: Mapping | None) -> str | None:
    """"First NaN/Inf: <point> on the candidate (124 values: 124 inf)", or None when all finite."""
    if not nonfinite:
        return None
    where = "both sides" if nonfinite.get("side") == "both" else f"the {nonfinite.get('side')}"
    kinds = ", ".join(f"{nonfinite[k]} {k}" for k in ("inf", "nan") if nonfinite.get(k))
    return f"First NaN/Inf: {nonfinite.get('point')} on {where} ({nonfinite.get('count')} values" + \
        (f": {kinds})" if kinds else ")")


def divergence_sentence(first: Mapping) -> str:
    """"Everything up to X agrees at rounding level (...); the first divergence is Y: ..."."""
    numbers = (
        f"max|diff| {fmt(first.get('max_abs'))}, max|ref| {fmt(first.get('max_ref'))}, "
        f"rel_l2 {fmt(first.get('rel_l2'))}"
    )
    last = first.get("last_agreeing")
    if not last:
        return f"The very first point already diverges: {first['point']}: {numbers}"
    n = first.get("upstream_points")
    worst = number(first.get("upstream_max_rel_l2"))
    exact = worst == 0
    upstream = "rel_l2 = 0" if exact else f"rel_l2 ≤ {fmt(worst)}"
    if n is not None:
        upstream += f" over {n} point" + ("" if n == 1 else "s")
    how = "exactly" if exact else "at rounding level"
    gap = first.get("unseen") or []
    between = f" ({len(gap)} points between them not recorded)" if gap else ""
    return (
        f"Everything up to {last} agrees {how} ({upstream}); "
        f"the first divergence is {first['point']}{between}: {numbers}"
    )


def match_sentence(summary: Summary) -> str:
    pts = points(summary)
    compared = sum(1 for p in pts if p.get("recorded"))
    missing = len(pts) - compared
    text = f"All {compared} compared points are within tolerance (a point fails when {tolerance_text(summary)})"
    worst = worst_point(summary)
    if worst is not None:
        text += f"; the largest rel_l2 is {fmt(worst['rel_l2'])} at {worst['point']}"
    if missing:
        text += f"; {missing} point" + (" is" if missing == 1 else "s are") + " not recorded on one side"
    return text


def hints(summary: Summary) -> list[str]:
    """The diff engine's hints about the first divergence (what its signature suggests), if any."""
    first = summary.get("first_divergence") or {}
    return [str(hint.get("text", hint)) if isinstance(hint, Mapping) else str(hint)
            for hint in first.get("hints") or []]


def first_difference(reference: list, candidate: list, same_prefix: int | None) -> int | None:
    """Index of the first differing greedy token, as the result states it (None if identical)."""
    if same_prefix is None or (same_prefix >= len(reference) and same_prefix >= len(candidate)):
        return None
    return same_prefix


def greedy_cell(same_prefix: int | None, steps: int | None) -> str:
    """"17/20": the greedy agreement in a table cell."""
    return DASH if same_prefix is None else f"{same_prefix}/{steps}"


def greedy_text(greedy: dict) -> str:
    """'17/20 tokens same prefix, first flip at step 18 (18/20 positions agree)'."""
    ref, cand = greedy.get("reference") or [], greedy.get("candidate") or []
    steps = greedy.get("steps") or max(len(ref), len(cand))
    same = greedy.get("same_prefix")
    if same is None:
        return "—"
    if same >= steps:
        return f"identical ({steps}/{steps} tokens)"
    flip = greedy.get("first_flip") or same + 1
    positions = greedy.get("same_positions")
    agree = f" ({positions}/{steps} positions agree)" if positions is not None else ""
    return f"{same}/{steps} tokens same prefix, first flip at step {flip}{agree}"


def regime_lines(summary: Summary) -> list[str]:
    """What the regime view adds, in plain sentences (terminal, Markdown, HTML alike): which view the
    verdict speaks of, what the raw f32 view said, what the regime itself costs, the per-op view.
    Empty for a raw run."""
    regime = summary.get("regime")
    if not regime:
        return []
    judged = ("each op on the candidate's own inputs" if regime.get("verdict_view") == "per_op"
              else "free-running")
    if regime.get("floor_at_bound"):  # the caveats name this CPU's own code paths
        judged += f", every op against at least {fmt(regime.get('per_op_bound'))} (the paths a caveat names)"
    lines = [f"view: the regime {regime.get('label')} (the reference is tracer's model in the candidate's number "
             f"formats, judged {judged}; the verdict above speaks of it)"]
    raw = regime.get("raw") or {}
    first = raw.get("first_divergence")
    raw_label = side_label(raw.get("reference"))
    lines.append(f"raw view against f32 {raw_label}: {raw.get('verdict')}" + (
        f", first at {first['point']} (rel_l2 {fmt(first.get('rel_l2'))})" if first else ""))
    cost = {point: number(error) for point, error in (regime.get("cost") or {}).items()}
    if cost:
        worst = max(cost, key=lambda point: _rank(cost[point]))
        text = f"the regime's own cost over f32: largest rel_l2 {fmt(cost[worst])} at {worst}"
        logits = next((cost[p] for p in (LOGITS, FINAL_LOGITS) if p in cost), None)
        lines.append(text + (f"; logits {fmt(logits)}" if logits is not None and worst != LOGITS else ""))
    per_op_worst = regime.get("per_op_worst")
    if per_op_worst and number(per_op_worst["rel_l2"]) == 0:
        lines.append("per op on the candidate's own inputs: every op exactly equal")
    elif per_op_worst:
        over = regime.get("per_op_over") or []
        lines.append(f"per op on the candidate's own inputs: worst rel_l2 {fmt(per_op_worst['rel_l2'])} at "
                     f"{per_op_worst['point']}; " + (f"{len(over)} point(s) over {fmt(regime.get('per_op_bound'))}, "
                                                      f"first {over[0]}" if over else
                                                      f"every op within {fmt(regime.get('per_op_bound'))}"))
    lines += audit_lines(regime.get("audit"))
    lines += [f"caveat: {caveat}" for caveat in regime.get("caveats") or []]
    return lines


def audit_lines(audit: Mapping | None) -> list[str]:
    """The audit of the GGUF a regime took its tensors from: one line when every tensor is
    identical, legitimate or not audited, one line per damaged tensor; one more where it was read from
    the cache."""
    if not audit:
        return []
    cached = ["audit read from the cache (an earlier run audited this file against these weights)"] \
        if audit.get("cached") else []
    return _audit_verdict_lines(audit) + cached


def _audit_verdict_lines(audit: Mapping) -> list[str]:
    name = PurePath(audit.get("file") or "?").name
    counts, total = audit.get("counts") or {}, len(audit.get("tensors") or {})
    verdict = audit.get("verdict")
    if verdict == "not_audited":
        return [f"audit of {name}: {audit.get('why')}"]
    if verdict == "identical":
        return [f"audit of {name}: every one of its {total} tensors is what llama.cpp's quantizer makes of the "
                f"reference's weights, byte for byte ({audit.get('quantizer')})"]
    if verdict == "other_weights":
        return [f"audit of {name}: not a quantization of the reference's weights ({counts.get('damaged')} of {total} "
                "tensors hold blocks that no scale explains); the regime takes its bytes as they are: trace it with "
                "the model it was made from"]
    lines = []
    differ = counts.get("legitimate", 0) + counts.get("unchecked", 0)
    if differ:
        worst = audit.get("legitimate_worst") or {}
        text = (f"audit of {name}: {differ} of {total} tensors differ from llama.cpp's requantization of the "
                "reference's weights as another quantization does (an importance matrix, another quantizer: every "
                "quant on the level nearest its value for some scale)")
        if worst:
            text += (f", at most {_times(worst.get('error_ratio'))} the error {str(worst.get('type')).upper()} gives "
                     f"there ({worst.get('tensor')})")
        if counts.get("unchecked"):
            text += f"; {counts['unchecked']} of a type the audit does not judge"
        lines.append(text + "; the regime takes the file's bytes")
    for tensor in audit.get("damaged") or []:
        kind, off = str(tensor.get("type")).upper(), tensor.get("off_blocks")
        blocks = "one block" if off == 1 else f"{off} blocks"
        steps = number(tensor.get("steps_off"))
        why = f" (a quant {steps:.1f} steps off its value)" if steps is not None and steps > 0.5 else ""
        lines.append(f"audit: {tensor.get('tensor')} ({kind}) damaged: {blocks} of {tensor.get('blocks')} at "
                     f"{_times(tensor.get('error_ratio'))} the error {kind} gives here{why}; the regime takes it "
                     "requantized from the reference's weights")
    return lines


def _times(ratio) -> str:
    """41× / 7.5×: an error ratio as a user reads it."""
    value = number(ratio)
    if value is None:
        return "?×"
    if value > 1000:  # the requantization is exact there (the reference on the type's own grid)
        return "over 1000×"
    return f"{value:.0f}×" if value >= 10 else f"{value:.1f}×"


def regime_cost_by_layer(summary: Summary) -> list[tuple[str, float | None]]:
    """(block, largest rel_l2 the regime adds there over f32) in execution order: where a user of
    the quantized model pays. Points outside the blocks are their own rows."""
    rows: dict[str, float] = {}
    for point, error in ((summary.get("regime") or {}).get("cost") or {}).items():
        layer, _ = split_point(point)
        key = point if layer is None else f"layer {layer}"
        value = number(error)
        if value is not None:
            rows[key] = max(rows.get(key, value), value, key=_rank)
    return list(rows.items())


# The flags of a `tracer run` line that choose the input and the model: a recording for `tracer
# diagnose` must be made on the same ones.
INPUT_FLAGS = ("--model", "--prompt", "--prompt-file", "--tokens", "--max-tokens", "--system")


def command_words(command: str | None) -> list[str]:
    try:
        return shlex.split(command or "")
    except ValueError:  # an unbalanced quote in a command someone edited by hand
        return []


def flag_value(words: list[str], flag: str) -> str | None:
    """The value a command line gives `flag` (`--flag V` or `--flag=V`), the last one winning."""
    value = None
    for i, word in enumerate(words):
        if word == flag and i + 1 < len(words):
            value = words[i + 1]
        elif word.startswith(flag + "="):
            value = word.split("=", 1)[1]
    return value


def next_steps(summary: Summary) -> list[tuple[str, str]]:
    """What to run next, as (what it does, the command): the line that repeats this run and, for a
    divergence, the one that finds which porting mistake reproduces it (a planted variant of
    tracer's own model already is one: the sweep compares it with every other)."""
    steps = [("repeat this run", str(summary["command"]))] if summary.get("command") else []
    first = summary.get("first_divergence")
    if summary.get("verdict") != "diverged" or not first:
        return steps
    candidate = summary.get("candidate") or {}
    words = command_words(summary.get("command"))
    model = flag_value(words, "--model")
    inputs = [word for flag in INPUT_FLAGS if flag_value(words, flag) is not None
              for word in (flag, flag_value(words, flag))] + (["--chat"] if "--chat" in words else [])
    if candidate.get("variant") and candidate.get("engine") in ("reimpl", "hf"):
        steps.append((f"{variant_text(candidate['variant'])} is a porting mistake planted in tracer's own model: "
                      "a port whose first divergence and hint read like these has it; every planted mistake "
                      "side by side", shlex.join(["tracer", "sweep", *inputs])))
        return steps
    if words[1:2] == ["compare"] and len(words) > 3:
        trace, model = words[3], reference_model(summary)
    elif (flag_value(words, "--candidate") or "").startswith("file:"):
        trace = flag_value(words, "--candidate").removeprefix("file:")
    else:
        engine = flag_value(words, "--candidate") or candidate.get("engine") or "reimpl"
        record = shlex.join(["tracer", "record", "--engine", engine, *inputs, "-o", "candidate.safetensors"])
        steps.append(("save the candidate's trace", record))
        trace = "candidate.safetensors"
    steps.append(("which porting mistake reproduces it: tracer plants each in its own model and ranks them by "
                  "resemblance to the trace", shlex.join(["tracer", "diagnose", trace]
                                                          + (["--model", model] if model else []))))
    return steps


def reference_model(summary: Summary) -> str | None:
    """The model a compare's reference trace was recorded on, where that folder is here to load (the
    trace names it as `--model` was given): `tracer diagnose` needs it, its default being SmolLM2."""
    model = summary.get("model")
    return model if model and Path(model, "config.json").is_file() else None


def divergence_facts(summary: Summary) -> list[tuple[str, str]]:
    """The first divergence as the report's first screen states it: where, the error made there
    (local: its block rerun on the reference's inputs) against its tolerance, the error it inherits,
    and its total error; for a run without one, the largest error."""
    first = summary.get("first_divergence")
    if not first:
        worst = worst_point(summary)
        if worst is None:
            return []
        if number(worst["rel_l2"]) == 0:
            return [("largest error", "none: every compared point is exactly equal")]
        bound = number(worst.get("threshold"))
        of = f" (its tolerance {fmt(bound)})" if bound else ""
        return [("largest error", f"rel_l2 {fmt(worst['rel_l2'])}{of} at {worst['point']}")]
    facts = [("first divergence", str(first["point"]))]
    local, bound = number(first.get("local_rel_l2")), number(first.get("threshold"))
    over = f", {fmt(local / bound)}× its tolerance {fmt(bound)}" if local is not None and bound else ""
    if local is not None:
        cache = " and cache" if summary.get("step") is not None else ""  # a decode step: the cache is an input
        facts.append(("error made there", f"rel_l2 {fmt(local)}{over} (local: its block rerun on the "
                                          f"reference's inputs{cache})"))
    n = first.get("upstream_points")
    if first.get("unseen"):
        unseen = first["unseen"]
        facts.append(("error it inherits", f"unknown: not recorded before it: {', '.join(unseen)}"))
    elif first.get("last_agreeing"):
        upstream = number(first.get("upstream_max_rel_l2"))
        over = f"over the {n} point{'' if n == 1 else 's'} before it"
        facts.append(("error it inherits", f"none (rel_l2 = 0 {over})" if upstream == 0 else
                      f"rel_l2 ≤ {fmt(upstream)} {over}"))
    facts.append(("error there, in all", f"rel_l2 {fmt(first.get('rel_l2'))} · max|diff| {fmt(first.get('max_abs'))}"
                                         f" · max|ref| {fmt(first.get('max_ref'))}"))
    nonfinite = nonfinite_text(summary.get("first_nonfinite"))
    if nonfinite:
        facts.append(("NaN/Inf", nonfinite.removeprefix("First NaN/Inf: ")))
    return facts


def outcome_facts(summary: Summary) -> list[tuple[str, str]]:
    """What the divergence does to the model's output: the decode steps, the logits and the greedy continuation."""
    decoded = steps_line(summary)
    facts = [("decode steps", decoded)] if decoded else []
    logits = summary.get("logits")
    if logits:
        facts.append(("logits, last position", f"max|diff| {fmt(logits.get('max_abs'))} · max|ref| "
                                                f"{fmt(logits.get('max_ref'))} · rel_l2 {fmt(logits.get('rel_l2'))}"))
        agree, n = logits.get("argmax_agree"), logits.get("positions")
        argmax = "" if agree is None else " · argmax agrees at " + (
            f"{round(agree * n)}/{n} positions" if n else percent(agree))
        facts.append(("logits, all positions", f"max|diff| {fmt(logits.get('max_abs_all'))}{argmax}"))
    greedy = summary.get("greedy")
    if greedy:
        steps = greedy.get("steps") or len(greedy.get("reference") or [])
        facts.append((f"greedy, {steps} tokens", greedy_text(greedy)))
    return facts


def steps_line(s: dict) -> str | None:
    """A decoded run's steps in one line (`--decode N`): "prefill: match; first divergence: decode step 3
    (position 8), model.layers.0.self_attn.k_rope"; None for a run without steps."""
    steps = s.get("steps") or []
    if not steps:
        return None
    prefill = "diverged" if s["verdict"] != "match" and s.get("step") is None else "match"
    first = next((step for step in steps if step["verdict"] != "match"), None)
    if first is None:
        return f"prefill: {prefill}; {len(steps) - 1} decode steps: match at every step and point"
    if prefill == "diverged":
        diverged = sum(step["verdict"] != "match" for step in steps[1:])
        return f"prefill: diverged; {diverged} of {len(steps) - 1} decode steps diverge (after the prefill's error)"
    where = ("the cached prefill (what the KV cache keeps)" if first["step"] == 0
             else f"decode step {first['step']} (position {first['position']})")
    point = first["first_divergence"]["point"] if first.get("first_divergence") else "?"
    return f"prefill: {prefill}; first divergence: {where}, {point}{step_origin_text(first)}{cached_greedy_text(steps)}"


def step_origin_text(step: dict) -> str:
    """Whether a diverged step makes its error or inherits it (the step rerun on the reference's inputs
    and cache: `local`, `inherited_from`); empty where not measured."""
    first = step.get("first_divergence") or {}
    if step.get("local") and first.get("localized_by") == "local":
        return (f", made by the step itself (local rel_l2 {fmt(first.get('local_rel_l2'))} on the reference's "
                "inputs and cache)")
    if step.get("local") is False and step.get("inherited_from") is not None:
        written = "the prefill" if step["inherited_from"] == 0 else f"decode step {step['inherited_from']}"
        return f", inherited from the cache written at {written} (the step itself makes none)"
    return ""


def cached_greedy_text(steps: list[dict]) -> str:
    """Where the candidate's own cached greedy pick first leaves the reference's (teacher forcing keeps
    both on the reference's tokens, so that is where its cached continuation would part)."""
    flip = next((step for step in steps if step.get("candidate_pick") is not None
                 and step["candidate_pick"] != step.get("reference_pick")), None)
    if flip is None:
        return ""
    after = "the prefill" if flip["step"] == 0 else f"decode step {flip['step']}"
    return f"; the candidate's own cached greedy pick first differs after {after}"
