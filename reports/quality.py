"""`tracer quality`'s renderings of its summary dict (`Quality.to_dict()`): llama-perplexity's own
statistics table, line for line (`perplexity_table`), the terminal summary (`quality_text`, every
line under 100 columns) and a Markdown block to paste into an issue (`quality_markdown`)."""

from __future__ import annotations

import textwrap

from tracer.reports.markdown import cell, fenced, text

WIDTH = 99  # the terminal summary's lines stay under 100 columns


def _label(percent: str) -> str:
    """"5.0" -> " 5.0%", as llama-perplexity pads its percentile labels."""
    return f"{percent:>4}%"


def perplexity_table(summary: dict) -> str:
    """The statistics llama-perplexity prints at the end of a `--kl-divergence` run, same labels,
    same formats (its `LOG` lines)."""
    s = summary["statistics"]

    def pm(name: str, width: int = 10, places: int = 6) -> str:
        return f"{s[name]['value']:{width}.{places}f} ± {s[name]['uncertainty']:{width}.{places}f}"

    def percent(name: str) -> str:
        return f"{100 * s[name]['value']:6.3f} ± {100 * s[name]['uncertainty']:5.3f} %"

    lines = ["====== Perplexity statistics ======",
             f"Mean PPL(Q)                   : {pm('ppl')}",
             f"Mean PPL(base)                : {pm('ppl_base')}",
             f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * s['correlation']:6.2f}%",
             f"Mean ln(PPL(Q)/PPL(base))     : {pm('log_ppl_ratio')}",
             f"Mean PPL(Q)/PPL(base)         : {pm('ppl_ratio')}",
             f"Mean PPL(Q)-PPL(base)         : {pm('ppl_diff')}",
             "",
             "====== KL divergence statistics ======",
             f"Mean    KLD: {pm('kld')}",
             f"Maximum KLD: {s['kld_max']:10.6f}"]
    kld = s["kld_percentiles"]
    lines += [f"{_label(p)}   KLD: {kld[p]:10.6f}" for p in ("99.9", "99.0", "95.0", "90.0")]
    lines.append(f"Median  KLD: {s['kld_median']:10.6f}")
    lines += [f"{_label(p)}   KLD: {kld[p]:10.6f}" for p in ("10.0", "5.0", "1.0", "0.1")]
    lines += [f"Minimum KLD: {s['kld_min']:10.6f}",
              "",
              "====== Token probability statistics ======",
              f"Mean    Δp: {percent('p_diff')}",
              f"Maximum Δp: {100 * s['p_diff_max']:6.3f}%"]
    dp = s["p_diff_percentiles"]
    lines += [f"{_label(p)}   Δp: {100 * dp[p]:6.3f}%" for p in ("99.9", "99.0", "95.0", "90.0", "75.0")]
    lines.append(f"Median  Δp: {100 * s['p_diff_median']:6.3f}%")
    lines += [f"{_label(p)}   Δp: {100 * dp[p]:6.3f}%" for p in ("25.0", "10.0", "5.0", "1.0", "0.1")]
    lines += [f"Minimum Δp: {100 * s['p_diff_min']:6.3f}%",
              f"RMS Δp    : {percent('rms_p_diff')}",
              f"Same top p: {percent('same_top')}"]
    return "\n".join(lines)


def _wrapped(line: str, indent: str = "    ") -> list[str]:
    return textwrap.wrap(line, WIDTH, subsequent_indent=indent, break_on_hyphens=False) or [""]


def heading(summary: dict) -> str:
    return f"tracer quality: {summary['candidate']['label']} against {summary['reference']['label']}"


def scope(summary: dict) -> str:
    """"307 tokens of porting.txt, 2 chunks of 128, 126 scored tokens"."""
    source = f" of {summary['text']}" if summary.get("text") else ""
    bos = f", BOS {summary['bos']} at each chunk's start" if summary.get("bos") is not None else ""
    return (f"{summary['tokens']} tokens{source}, {summary['chunks']} chunks of {summary['ctx']}, "
            f"{summary['scored']} scored tokens (the second half of each chunk){bos}")


def quality_text(summary: dict) -> str:
    """The terminal summary: what ran on what, llama-perplexity's table, where the loss is made."""
    lines = _wrapped(heading(summary))
    lines += _wrapped(f"  model {summary['model']}") if summary.get("model") else []
    lines += _wrapped(f"  {scope(summary)}")
    s = summary["statistics"]
    lines += _wrapped(f"  mean KLD {s['kld']['value']:.6f}, same top {100 * s['same_top']['value']:.3f}%, "
                      f"PPL {s['ppl']['value']:.4f} vs {s['ppl_base']['value']:.4f} "
                      f"(ΔPPL {s['ppl_diff']['value']:+.4f})")
    lines += _wrapped(f"  exact mean KLD {summary['exact_kld']['value']:.6g} (whole vocabulary in f64, without "
                      "llama-perplexity's 16-bit base and -16 cutoff)")
    lines += ["", perplexity_table(summary)]
    if summary.get("layers"):
        lines += ["", *layers_text(summary["layers"])]
    for note in summary.get("notes", []):
        lines += _wrapped(f"note: {note}")
    return "\n".join(lines)


def _share(value: float) -> str:
    return "n/a" if value != value else f"{100 * value:.1f}%"  # NaN: the candidate lost nothing to share


def layers_text(layers: dict) -> list[str]:
    lines = ["====== Where the loss is made ======",
             "each component alone the candidate's, inside the reference's forward (exact KLD):",
             f"  {'component':<22} {'KLD':>11} {'share':>8} {'same top':>9}"]
    for share in layers["shares"]:
        lines.append(f"  {share['component']:<22} {share['kld']:11.3e} {_share(share['share']):>8} "
                     f"{100 * share['same_top']:8.2f}%")
    lines += _wrapped(f"sum of shares {_share(layers['sum_of_shares'])} of the measured exact KLD "
                      f"{layers['total_kld']:.6g}; the emulated candidate's own {layers['emulated_kld']:.6g}; "
                      f"floor (the emulated reference's from the real one) {layers['floor_kld']:.2e}")
    lines += _wrapped(f"reference emulated as {layers['reference']}; candidate as {layers['candidate']} "
                      f"({layers['seconds']:.1f} s)")
    for caveat in layers.get("caveats", []):
        lines += _wrapped(f"caveat: {caveat}")
    return lines


def quality_markdown(summary: dict) -> str:
    """A Markdown block for an issue: the headline figures, where the loss is made, the command."""
    s = summary["statistics"]

    def pm(name: str, scale: float = 1.0, places: int = 6, unit: str = "") -> str:
        return f"{scale * s[name]['value']:.{places}f} ± {scale * s[name]['uncertainty']:.{places}f}{unit}"

    exact = summary["exact_kld"]
    rows = [("Mean KLD", pm("kld")),
            ("Mean KLD, exact (f64, whole vocabulary)", f"{exact['value']:.6g} ± {exact['uncertainty']:.2g}"),
            ("Median KLD", f"{s['kld_median']:.6f}"),
            ("99.0% KLD", f"{s['kld_percentiles']['99.0']:.6f}"), ("Maximum KLD", f"{s['kld_max']:.6f}"),
            ("Same top p", pm("same_top", 100, 3, " %")), ("RMS Δp", pm("rms_p_diff", 100, 3, " %")),
            ("Mean Δp", pm("p_diff", 100, 3, " %")), ("PPL(Q)", pm("ppl")), ("PPL(base)", pm("ppl_base")),
            ("PPL(Q) − PPL(base)", pm("ppl_diff")), ("ln(PPL(Q)/PPL(base))", pm("log_ppl_ratio")),
            ("Cor(ln PPL(Q), ln PPL(base))", f"{100 * s['correlation']:.2f} %")]
    parts = [f"### {text(heading(summary))}", "", text(scope(summary)) + ".", "",
             "| figure (llama-perplexity's definitions) | value |", "|---|---|"]
    parts += [f"| {cell(name)} | {cell(value)} |" for name, value in rows]
    layers = summary.get("layers")
    if layers:
        parts += ["", "#### Where the loss is made", "",
                  "Each component alone the candidate's, inside the reference's forward; exact KLD "
                  f"(sum of shares {_share(layers['sum_of_shares'])}; the emulated candidate's KLD "
                  f"{layers['emulated_kld']:.6g}, measured {layers['total_kld']:.6g}; floor "
                  f"{layers['floor_kld']:.2e}).", "",
                  "| component | KLD | share | same top |", "|---|---|---|---|"]
        parts += [f"| {cell(x['component'])} | {x['kld']:.3e} | {_share(x['share'])} | "
                  f"{100 * x['same_top']:.2f}% |" for x in layers["shares"]]
    if summary.get("notes"):
        parts += [""] + [f"- {text(note)}" for note in summary["notes"]]
    if summary.get("command"):
        parts += ["", fenced(summary["command"], "sh")]
    return "\n".join(parts) + "\n"
