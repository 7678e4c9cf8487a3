"""Reading a triangulation's summary (`Triangulation.to_dict()`, its summary.json): the phrases and the
agreement matrices the terminal, summary.md and report.html show alike. Only selects and phrases.

Each side gets a letter, R for the reference and A, B, ... for the candidates in the order given; an
agreement matrix is lower-triangular, one row and one column per side that recorded the point, each cell
the rel_l2 of its row's side against its column's with ✓ (within the row's bound) or ✗ (beyond it).
"""

from __future__ import annotations

from string import ascii_uppercase

from tracer.model.points import FINAL_LOGITS, LOGITS
from tracer.reports.summary import (
    Summary,
    fmt,
    greedy_text,
    input_label,
    model_name,
    runtime_text,
    tolerance_text,
    worst_point,
)

REFERENCE_LETTER = "R"
SUBDIR = "candidate-{}"  # each candidate's own report folder inside a triangulation's


def is_triangulation(summary: Summary) -> bool:
    return summary.get("kind") == "triangulation"


def letters(summary: Summary) -> dict[str, str]:
    """Side name -> its letter: R for the reference, A, B, ... for the candidates (past Z, C27, ...)."""
    names = summary.get("sides") or []
    marks = [REFERENCE_LETTER, *(ascii_uppercase[i] if i < 26 else f"C{i + 1}" for i in range(len(names) - 1))]
    return dict(zip(names, marks))


def side_rows(summary: Summary) -> list[tuple[str, str, str]]:
    """(letter, name, what it is) per side: the reference, then each candidate with its runtime."""
    names, candidates = summary.get("sides") or [], summary.get("candidates") or []
    rows = [(REFERENCE_LETTER, names[0], "reference" + _runtime(summary.get("reference")))] if names else []
    marks = letters(summary)
    rows += [(marks[name], name, "candidate" + _runtime(one.get("candidate")))
             for name, one in zip(names[1:], candidates)]
    return rows


def _runtime(side) -> str:
    runtime = runtime_text(side)
    return f", {runtime}" if runtime else ""


def triangulation_title(summary: Summary) -> str:
    """"hf[theta=10000] vs 3 candidates — llama — 7 tokens"."""
    n = len(summary.get("candidates") or [])
    return f"{summary['reference']['label']} vs {n} candidates — {model_name(summary)} — {input_label(summary)}"


def triangulation_sentence(summary: Summary) -> str:
    """What the verdict means: how many candidates diverge from the reference."""
    candidates = summary.get("candidates") or []
    diverged = sum(one.get("verdict") != "match" for one in candidates)
    if not diverged:
        return f"Every one of the {len(candidates)} candidates matches the reference at every point it recorded."
    return f"{diverged} of the {len(candidates)} candidates diverge from the reference."


def candidate_text(candidate: Summary) -> str:
    """One candidate against the reference, in one phrase: its verdict, where it first diverges (or its
    largest error), the logits and its greedy continuation."""
    first = candidate.get("first_divergence")
    if first:
        text = f"diverged at {first['point']} (rel_l2 {fmt(first.get('rel_l2'))})"
    else:
        worst = worst_point(candidate)
        text = "match" + (f" (largest rel_l2 {fmt(worst['rel_l2'])} at {worst['point']})" if worst else "")
    logits = candidate.get("logits")
    if logits:
        text += f"; logits max|diff| {fmt(logits.get('max_abs'))}"
    if candidate.get("greedy"):
        text += f"; greedy {greedy_text(candidate['greedy'])}"
    return text


def odd_one_text(summary: Summary) -> str | None:
    """The verdict area's line on the odd one (None for a run where every candidate matches and no side
    stands out)."""
    odd, marks = summary.get("odd_one"), letters(summary)
    n = len(marks) - 1
    if odd and odd.get("role") == "reference":
        return (f"odd one: the reference {odd['side']} at {odd['point']}: the {n} candidates agree with each other "
                "there and each disagrees with it beyond the bound; the reference may be the wrong side")
    if odd:
        return (f"odd one: {marks.get(odd['side'], '?')} {odd['side']} at {odd['point']}: it disagrees with the "
                "reference and every other candidate there beyond the bound, while they agree with each other")
    if summary.get("verdict") == "diverged":
        return "no odd one: at no point shown does one side alone disagree with all the others"
    return None


def row_title(row: Summary, marks: dict[str, str]) -> str:
    """"model.layers.0.self_attn.q_rope, the first divergence of A, B and C" / "lm_head, the logits"."""
    first_of = [marks.get(name, name) for name in row.get("first_of") or []]
    whose = ", ".join(first_of[:-1]) + f" and {first_of[-1]}" if len(first_of) > 1 else "".join(first_of)
    what = [f"the first divergence of {whose}"] if first_of else []
    if row.get("point") in (LOGITS, FINAL_LOGITS) and not first_of:
        what.append("the logits")
    return row["point"] + "".join(f", {piece}" for piece in what)


def row_odd_text(row: Summary, marks: dict[str, str]) -> str:
    """"; odd one here: C" where the row has one (the verdict line names the first row's only), else ""."""
    odd = row.get("odd_one")
    return f"; odd one here: {marks.get(odd, odd)}" if odd else ""


def floor_text(row: Summary, summary: Summary) -> str:
    """What judged every pair of the row: the bound and where it comes from."""
    if row.get("floor") == "allclose":
        return f"a pair agrees unless {tolerance_text(summary)}"
    if row.get("floor") == "noise":
        factor = (summary.get("tolerance") or {}).get("noise_factor")
        return (f"a pair agrees within rel_l2 {fmt(row.get('threshold'))}: {fmt(factor)} × the reference's f64 "
                f"rounding noise here ({fmt(row.get('noise'))}), the bound each candidate had against it")
    return f"a pair agrees within rel_l2 {fmt(row.get('threshold'))}: the fixed bound (no noise floor measured here)"


def agreement_matrix(row: Summary, marks: dict[str, str]) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the row's lower-triangular matrix: one column per side but the last, one row per side
    but the first, a cell per pair ("0.412 ✗", "0 ✓", "—" where a side did not record the point)."""
    names = list(marks)
    cells = {tuple(pair["sides"]): pair_cell(pair) for pair in row.get("pairs") or []}
    header = ["", *(marks[name] for name in names[:-1])]
    rows = [[marks[name], *(cells.get((other, name), "—") for other in names[:i]), *[""] * (len(names) - 1 - i)]
            for i, name in enumerate(names) if i > 0]  # the cells above the diagonal are blank
    return header, rows


def pair_cell(pair: Summary) -> str:
    if pair.get("agree") is None:
        return "—"
    return f"{fmt(pair.get('rel_l2'))} {'✓' if pair['agree'] else '✗'}"


def not_recorded(row: Summary, marks: dict[str, str]) -> list[str]:
    """Sides that did not record the row's point, each with why (what its cells' — means)."""
    recorded = set(row.get("sides") or [])
    reasons = {}
    for pair in row.get("pairs") or []:
        for name in pair["sides"]:
            if name not in recorded and pair.get("reason"):
                reasons.setdefault(name, pair["reason"])
    return [f"{marks.get(name, name)} {name}: {reasons.get(name, 'not recorded')}" for name in marks
            if name not in recorded]
