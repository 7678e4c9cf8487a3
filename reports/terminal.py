"""The short summary `tracer run` prints: verdict, where it starts, the figures."""

from __future__ import annotations

from tracer.reports.summary import greedy_text, nonfinite_text, regime_lines, runtime_text, worst_point


def _g(value) -> str:
    return "n/a" if value is None else value if isinstance(value, str) else f"{value:.3g}"


def terminal_summary(result, out_dir=None) -> str:
    """A few lines for the terminal; `result` is a Result or its dict."""
    s = result.to_dict() if hasattr(result, "to_dict") else result
    on = f" on {s['model']}" if s.get("model") else ""  # two foreign dumps may name no model
    lines = [f"tracer: {s['reference']['label']} vs {s['candidate']['label']}{on}"]
    lines += [f"  {role} runtime: {runtime_text(s[role])}" for role in ("reference", "candidate")
              if runtime_text(s.get(role))]
    if s.get("prompt") is not None:
        prompt = s["prompt"] if len(s["prompt"]) <= 80 else s["prompt"][:77] + "..."
        chat = " through the chat template" if s.get("chat") else ""
        lines.append(f"  prompt {prompt!r}{chat} ({len(s['tokens'])} tokens)")
    if s["verdict"] == "error":
        return "\n".join(lines + [f"verdict: ERROR  {s['error']}"])
    recorded = [p for p in s["points"] if p["recorded"]]
    lines.append(f"verdict: {s['verdict'].upper()}  ({len(recorded)} points compared, "
                 f"criterion {s['tolerance']['text']})")
    first = s["first_divergence"]
    if first:
        if first["last_agreeing"]:
            lines.append(f"  agrees up to {first['last_agreeing']} "
                         f"(max rel_l2 {_g(first['upstream_max_rel_l2'])} over {first['upstream_points']} points)")
        lines.append(f"  first divergence: {first['point']}  max|diff| {_g(first['max_abs'])}  "
                     f"max|ref| {_g(first['max_ref'])}  rel_l2 {_g(first['rel_l2'])}")
        lines += [f"  hint: {hint}" for hint in first.get("hints") or []]
    else:
        worst = worst_point(s)  # the report's choice too: a NaN ranks above every finite error
        if worst and worst["rel_l2"] == 0:
            lines.append("  every recorded point is bitwise identical")
        elif worst:
            lines.append(f"  largest error: {worst['point']} rel_l2 {_g(worst['rel_l2'])}")
    lines += [f"  {line}" for line in regime_lines(s)]
    if s.get("first_nonfinite"):
        lines.append(f"  {nonfinite_text(s['first_nonfinite'])}")
    logits = s.get("logits")
    if logits:
        lines.append(f"  logits, last position: max|diff| {_g(logits['max_abs'])} (max|ref| {_g(logits['max_ref'])}); "
                     f"all positions {_g(logits['max_abs_all'])}; "
                     f"argmax agrees at {logits['argmax_agree']:.0%} of positions")
    greedy = s.get("greedy")
    if greedy:
        lines.append(f"  greedy: {greedy_text(greedy)}")
    for note in s.get("notes", []):
        lines.append(f"  note: {note}")
    if out_dir is not None:
        lines.append(f"report: {out_dir}/report.html")
    return "\n".join(lines)
