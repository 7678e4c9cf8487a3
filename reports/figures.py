"""Figures of a result summary: the per-layer error curve and the layer × sub-point heatmap.

Figures are built as bare `matplotlib.figure.Figure` objects on an Agg canvas, never through
pyplot: nothing opens a window, nothing piles up in pyplot's figure registry, and a notebook's
own backend is left alone (no global `matplotlib.use`). Errors span ten decades, so both figures
use log scales; an exact zero has no place on a log axis and is drawn at a floor one decade
below the smallest non-zero value, with its own marker and legend entry.
"""

from __future__ import annotations

import io
import math
import textwrap
from dataclasses import dataclass

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import ListedColormap, LogNorm
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from tracer.model.points import (
    EMBED,
    FINAL_LOGITS,
    FINAL_NORM,
    K_PROJ,
    K_ROPE,
    LOGITS,
    V_PROJ,
    is_coarse,
    label,
    layer_of,
    layer_point,
    split_point,
)
from tracer.reports.routing_map import STATUS, routing_line
from tracer.reports.summary import (
    FIGURES,
    Summary,
    as_summary,
    breakdowns,
    comparison_title,
    figure_names,
    fmt,
    number,
    points,
    rel_l2_threshold,
    tolerance_text,
)

DPI = 110
CURVE_SIZE = (8.6, 5.0)  # inches: shown on the report's first screen at about 800 px
DEFAULT_FLOOR = 1e-12  # where exact zeros go when nothing else sets the scale

COLORS = {"rel": "#1f5fa8", "abs": "#8a4fb0", "ref": "#9a9a9a", "bad": "#c62828", "tol": "#e07b00"}
STYLE = {
    "font.size": 9,
    "axes.titlesize": 9,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "legend.fontsize": 8,
    "legend.framealpha": 0.9,
}



def plain(text: str) -> str:
    """User text for a matplotlib label: a '$' would otherwise switch on mathtext."""
    return text.replace("$", r"\$")


def figure_title(fig: Figure, text: str, points: float = 11) -> str:
    """A title that fits the figure's width (a long model path or prompt would run off both edges):
    broken between its " — " parts first, inside a part at words only where one is too long; user
    text made safe for mathtext."""
    width = int(fig.get_figwidth() * 72 / (0.62 * points))  # characters of bold sans at that size
    lines = []
    for line in plain(text).split("\n"):
        current = ""
        for part in line.split(" — "):
            joined = f"{current} — {part}" if current else part
            if current and len(joined) > width:
                lines.append(current)
                joined = part
            current = joined
        lines += textwrap.wrap(current, width, break_long_words=False) or [""]
    return "\n".join(lines)


def new_figure(size: tuple[float, float]) -> Figure:
    fig = Figure(figsize=size, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def figure_png(fig: Figure) -> bytes:
    """PNG bytes of a figure; the metadata names tracer instead of a URL."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": "tracer reports"})
    return buf.getvalue()


# --- the per-layer curve -------------------------------------------------------------------


def coarse_label(point: str) -> str:
    layer = layer_of(point)
    return label(point) if layer is None else str(layer)


def coarse_x(coarse: list[dict]) -> np.ndarray:
    """x positions: blocks at their index; embed, norm and logits (and Gemma's capped logits) set apart
    by a small gap."""
    xs, block = [], 0
    for p in coarse:
        if p["point"] == EMBED:
            xs.append(-1.5)
        elif p["point"] == FINAL_NORM:
            xs.append(block + 0.5)
        elif p["point"] == LOGITS:
            xs.append(block + 2.0)
        elif p["point"] == FINAL_LOGITS:
            xs.append(block + 3.0)
        else:
            xs.append(float(layer_of(p["point"])))
            block = int(xs[-1]) + 1
    return np.array(xs)


def as_array(values: list) -> np.ndarray:
    """Floats with NaN where the summary has null (point not recorded); "inf"/"nan" parsed."""
    return np.array([np.nan if number(v) is None else number(v) for v in values], dtype=float)


def missing_mask(coarse: list[dict], key: str) -> np.ndarray:
    return np.array([number(p.get(key)) is None for p in coarse])


def floor_for(*arrays: np.ndarray, below: float | None = None) -> float:
    """A power of ten a decade under the smallest positive value (and under `below`, if given).

    Exact zeros are drawn there: under the data, so no zero can be read as a real error.
    """
    values = np.concatenate([a[np.isfinite(a) & (a > 0)] for a in arrays])
    if below is not None:
        values = np.append(values, below)
    if values.size == 0:
        return DEFAULT_FLOOR
    return 10.0 ** (math.floor(math.log10(values.min())) - 1)


def curve_figure(summary) -> Figure:
    """The coarse error curve: rel_l2 (top) and max|diff| (bottom) per block output, log scale.

    x runs over embeddings, every block output, the final norm and the logits. The tolerance is a
    horizontal line (rel_l2 criterion) and the first divergence a vertical line with its name.

    Args:
        summary: a `Result` or its summary dict.
    Returns:
        A Figure on an Agg canvas (save it with `figure_png` or `fig.savefig`).
    """
    summary = as_summary(summary)
    coarse = [p for p in points(summary) if is_coarse(p["point"])]
    with matplotlib.rc_context(STYLE):
        fig = new_figure(CURVE_SIZE)
        if not coarse:
            return empty_figure(fig, summary)
        top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
        x = coarse_x(coarse)
        diverged = np.array([bool(p.get("diverged")) for p in coarse])
        rel = as_array([p.get("rel_l2") for p in coarse])
        threshold = rel_l2_threshold(summary)
        bounds, noise = as_array([p.get("threshold") for p in coarse]), as_array([p.get("noise") for p in coarse])
        floor = floor_for(rel, bounds, noise, below=threshold)
        missing = missing_mask(coarse, "rel_l2")
        plot_series(top, x, rel, missing, diverged, floor, COLORS["rel"], "relative L2  ‖cand − ref‖ / ‖ref‖")
        set_log_limits(top, floor, rel)
        if np.isfinite(bounds).any():  # judged per point against its rounding noise
            add_noise_bands(top, x, bounds, noise, floor)
        else:
            add_tolerance(top, threshold)
        top.set_ylabel("relative L2")
        abs_, ref = as_array([p.get("max_abs") for p in coarse]), as_array([p.get("max_ref") for p in coarse])
        # max|ref| gives the scale of the tensors: absolute errors mean little without it
        bottom.plot(x, ref, color=COLORS["ref"], ls="--", lw=1, label="max |ref| (scale)")
        abs_floor = floor_for(abs_, ref)
        plot_series(bottom, x, abs_, missing_mask(coarse, "max_abs"), diverged, abs_floor, COLORS["abs"],
                    "max |cand − ref|")
        set_log_limits(bottom, abs_floor, abs_, ref)
        bottom.set_ylabel("max |diff|")
        set_coarse_ticks(bottom, coarse, x)
        bottom.set_xlabel("block output (layer index)")
        mark_first_divergence((top, bottom), summary, coarse, x)
        figure_legend(fig, (top, bottom))
        set_titles(fig, top, summary)
    return fig


def plot_series(ax, x, values, missing, diverged, floor, color, label):
    """One log-scale series; zeros as open triangles on a floor line, missing points as crosses.

    inf/NaN (a zero reference norm, a NaN in the candidate) have no place on the axis either:
    they are drawn as red triangles along the top edge.
    """
    zero = values == 0
    broken = ~missing & ~np.isfinite(values)
    # the line skips zeros: a segment down to the floor would draw a trend that is not there
    ax.plot(x, np.where(zero | broken, np.nan, values), color=color, lw=1.6, marker="o", ms=3.5,
            label=label)
    bad = diverged & np.isfinite(values)
    if bad.any():
        ax.plot(x[bad], values[bad], ls="none", marker="o", ms=6, color=COLORS["bad"],
                label="out of tolerance")
    if zero.any() or missing.any():
        ax.axhline(floor, color="#bbbbbb", lw=0.8)
        # labelled just outside the right edge, where no marker can sit on it
        ax.text(1.004, floor, "exact 0", transform=ax.get_yaxis_transform(), ha="left",
                va="center", fontsize=7.5, color="#777777", clip_on=False)
    if zero.any():
        ax.plot(x[zero], np.full(zero.sum(), floor), ls="none", marker="v", ms=7, mfc="white",
                mec=color, mew=1.4, label="exact 0 (on the floor line)")
    if missing.any():
        ax.plot(x[missing], np.full(missing.sum(), floor), ls="none", marker="x", ms=6,
                color=COLORS["ref"], label="not recorded")
    if broken.any():
        ax.plot(x[broken], np.full(broken.sum(), 0.93), ls="none", marker="^", ms=8,
                color=COLORS["bad"], transform=ax.get_xaxis_transform(), label="inf / NaN")


def set_log_limits(ax, floor: float, *series: np.ndarray) -> None:
    values = np.concatenate(series)
    peak = np.max(values[np.isfinite(values)], initial=floor)
    # limits first: a series drawn only as markers on the floor (every value an exact 0) leaves the
    # data limits empty, and switching an empty axis to log scale warns
    ax.set_ylim(floor / 4, max(peak, floor * 10) * 100)  # headroom above for the annotation
    ax.set_yscale("log")


def add_tolerance(ax, threshold: float | None) -> None:
    if threshold is None:
        return
    ax.axhline(threshold, color=COLORS["tol"], ls=":", lw=1.6, label=f"tolerance (rel_l2 {threshold:.0e})")
    low, high = ax.get_ylim()
    high = max(high, threshold * 30)
    ax.axhspan(threshold, high, color=COLORS["bad"], alpha=0.05, lw=0, zorder=0)  # out of tolerance
    ax.set_ylim(low, high)


def add_noise_bands(ax, x: np.ndarray, bounds: np.ndarray, noise: np.ndarray, floor: float) -> None:
    """Per-point criterion: the rounding noise (grey band) and the bound derived from it (dotted).

    Each point has its own bound (a multiple of the error f32 rounding makes there), so the
    tolerance is a line that follows the points rather than one horizontal level.
    """
    if np.isfinite(noise).any():
        shown = np.where(noise > 0, noise, floor)
        ax.fill_between(x, floor, shown, color=COLORS["ref"], alpha=0.25, lw=0, step="mid",
                        label="rounding noise (f32 vs f64)")
    ax.plot(x, bounds, color=COLORS["tol"], ls=":", lw=1.6, drawstyle="steps-mid",
            label="tolerance per point (from the noise)")
    low, high = ax.get_ylim()
    high = max(high, np.nanmax(bounds) * 30)
    ax.fill_between(x, np.where(np.isfinite(bounds), bounds, high), high, color=COLORS["bad"], alpha=0.05,
                    lw=0, step="mid", zorder=0)  # out of tolerance
    ax.set_ylim(low, high)


def set_coarse_ticks(ax, coarse: list[dict], x: np.ndarray) -> None:
    """Every label up to ~40 ticks; beyond that every k-th block, always embed/norm/logits."""
    labels = [coarse_label(p["point"]) for p in coarse]
    step = max(1, math.ceil(len(labels) / 40))
    shown = [
        lab if (i % step == 0 or layer_of(p["point"]) is None) else ""
        for i, (lab, p) in enumerate(zip(labels, coarse))
    ]
    ax.set_xticks(x, shown, fontsize=8)
    ax.set_xlim(x.min() - 0.7, x.max() + 0.7)


def divergence_x(first: dict, coarse: list[dict], x: np.ndarray) -> float | None:
    """x of the coarse point that contains the first divergence (its block's output)."""
    names = [p["point"] for p in coarse]
    layer = first.get("layer")
    target = layer_point(layer, "") if layer is not None else first.get("point")
    return float(x[names.index(target)]) if target in names else None


def mark_first_divergence(axes, summary: Summary, coarse: list[dict], x: np.ndarray) -> None:
    first = summary.get("first_divergence")
    at = divergence_x(first, coarse, x) if first else None
    if at is None:
        return
    for ax in axes:
        ax.axvline(at, color=COLORS["bad"], ls="--", lw=1.2, alpha=0.8)
    where = "" if first.get("layer") is None else f"block {first['layer']}, "
    text = f"first divergence: {first['point']}  ({where}rel_l2 {fmt(first.get('rel_l2'))})"
    right_half = at > (x.min() + x.max()) / 2
    axes[0].annotate(
        plain(text), xy=(at, 0.97), xycoords=axes[0].get_xaxis_transform(),
        xytext=(-6 if right_half else 6, 0), textcoords="offset points",
        ha="right" if right_half else "left", va="top", fontsize=8.5, color=COLORS["bad"],
        bbox={"boxstyle": "round,pad=0.3", "fc": "white", "ec": COLORS["bad"], "alpha": 0.95},
    )


def figure_legend(fig: Figure, axes) -> None:
    """One legend strip under both panels; same label in both panels listed once."""
    entries = {}
    for ax in axes:
        for handle, name in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(name, handle)
    # measurements first, then reference lines, then marker meanings
    rank = ("relative", "max |cand", "max |ref", "rounding", "tolerance", "out of", "exact", "not rec")
    order = sorted(entries, key=lambda lab: next((i for i, r in enumerate(rank) if lab.startswith(r)), 99))
    entries = {label: entries[label] for label in order}
    fig.legend(entries.values(), entries.keys(), loc="outside lower center",
               ncols=min(len(entries), 4), frameon=False)


def set_titles(fig: Figure, ax, summary: Summary) -> None:
    fig.suptitle(figure_title(fig, comparison_title(summary)), fontsize=11, fontweight="bold")
    verdict = str(summary.get("verdict", "?")).upper()
    ax.set_title(plain(f"{verdict}   ·   fails when {tolerance_text(summary)}"), loc="left",
                 color="#444444")


def empty_figure(fig: Figure, summary: Summary) -> Figure:
    """What a run without points (a failed run) draws: the reason, in place of a curve."""
    reason = summary.get("error") or "no points were compared"
    fig.suptitle(figure_title(fig, comparison_title(summary)), fontsize=11, fontweight="bold")
    fig.text(0.5, 0.5, plain(f"Nothing to plot.\n{reason}"), ha="center", va="center",
             fontsize=11, color="#555555", wrap=True)
    return fig


# --- the layer × sub-point heatmaps: where error is made, where it is carried ---------------------

NEAR = 0.25  # a cell at over a quarter of its tolerance is "near" it
HEAT_COLORS = {  # (lightest, darkest) of each band; "out" starts saturated: no out cell reads as pale
    "in": ("#f7fbff", "#9ecae1"), "near": ("#fff5b8", "#fdae61"), "out": ("#e8412c", "#67000d"),
}


@dataclass
class LayerGrid:
    """The summary's per-layer points as (layer, sub-point) grids."""

    columns: list[str]  # sub-point names, in execution order
    total: np.ndarray  # rel_l2 (NaN where not recorded; inf/NaN metrics kept as such)
    local: np.ndarray | None  # rel_l2 with each block rerun on the reference's inputs; None: not measured
    bound: np.ndarray  # the rel_l2 each cell is judged by (NaN: none, the elementwise criterion)
    recorded: np.ndarray  # bool
    diverged: np.ndarray  # bool: out of tolerance by its total error, as the diff engine judged it

    @property
    def judged_by_bound(self) -> bool:
        """Every recorded cell has a rel_l2 bound, so a cell's error reads against its own tolerance."""
        return bool(self.recorded.any()) and bool(np.isfinite(self.bound[self.recorded]).all())


def layer_columns(summary: Summary) -> list[str]:
    """The heatmap's columns: every sub-point the result has, in execution order (a family's own)."""
    columns: dict[str, None] = {}
    for p in points(summary):
        layer, sub = split_point(p["point"])
        if layer is not None:
            columns.setdefault(sub)
    return list(columns)


def layer_cells(summary: Summary):
    """(point entry, (layer, column)) for every per-layer point of the result."""
    columns = {sub: i for i, sub in enumerate(layer_columns(summary))}
    for p in points(summary):
        layer, sub = split_point(p["point"])
        if layer is not None:
            yield p, (layer, columns[sub])


def layer_grid(summary: Summary) -> LayerGrid:
    cells = list(layer_cells(summary))
    shape = (max((layer for _, (layer, _) in cells), default=-1) + 1, len(layer_columns(summary)))
    total, local, bound = np.full(shape, np.nan), np.full(shape, np.nan), np.full(shape, np.nan)
    recorded, diverged = np.zeros(shape, dtype=bool), np.zeros(shape, dtype=bool)
    single = number(rel_l2_threshold(summary))
    for p, cell in cells:
        value = number(p.get("rel_l2"))
        if value is None:
            continue
        total[cell], recorded[cell], diverged[cell] = value, True, bool(p.get("diverged"))
        local[cell] = np.nan if number(p.get("local_rel_l2")) is None else number(p.get("local_rel_l2"))
        own = number(p.get("threshold"))
        bound[cell] = own if own is not None else single if single is not None else np.nan
    measured = any(p.get("local_rel_l2") is not None for p, _ in cells)
    return LayerGrid(layer_columns(summary), total, local if measured else None, bound, recorded, diverged)


def heatmap_panels(grid: LayerGrid) -> list[tuple[str, np.ndarray]]:
    """(title, the error shown) per panel: the local error beside the total one, where measured."""
    total = ("the error it has (total: what it inherits included)", grid.total)
    if grid.local is None:
        return [total]
    return [("the error each op makes (local: its block rerun on the reference's inputs)", grid.local), total]


def tolerance_ratio(errors: np.ndarray, grid: LayerGrid) -> np.ndarray:
    """Each cell's error over its own tolerance: ≤ NEAR in tolerance, up to 1 near it, over 1 out.
    inf and NaN stay as they are; unrecorded cells are NaN."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = errors / grid.bound
    ratio[~grid.recorded] = np.nan
    return ratio


def layer_heatmap_figure(summary) -> Figure:
    """Where the error is made: every sub-point of every layer, one panel for the error each op makes
    (local: its block rerun on the reference's inputs, where the run measured it) beside one for the
    error it has (total: what it inherits included), each cell coloured by its error over its own
    tolerance on a log scale whose colour bar marks the bands: in tolerance (blue), near it (yellow,
    over a quarter of it), out (red). The first divergence is outlined, no cell covered; unrecorded
    cells are hatched grey. With the elementwise criterion (no rel_l2 bound) the cells show rel_l2
    and the out-of-tolerance ones are crossed.

    Args:
        summary: a `Result` or its summary dict.
    Returns:
        A Figure on an Agg canvas; `fig.axes[i].images[0].get_array()` holds what panel i shows
        (the ratio to tolerance, or rel_l2), per (layer, sub-point).
    """
    summary = as_summary(summary)
    grid = layer_grid(summary)
    panels = heatmap_panels(grid)
    n_layers = grid.total.shape[0]
    height = min(14.0, max(3.0, 0.135 * n_layers + 2.0))
    with matplotlib.rc_context({**STYLE, "axes.grid": False}):
        fig = new_figure((11.4 if len(panels) == 2 else 8.0, height))
        if not grid.recorded.any():
            return empty_figure(fig, summary)
        axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
        by_bound = grid.judged_by_bound
        shown = [tolerance_ratio(errors, grid) if by_bound else errors for _, errors in panels]
        norm, cmap = heat_scale(shown, by_bound)
        labels = [label(layer_point(0, sub)) for sub in grid.columns]
        for ax, (title, errors), values in zip(axes, panels, shown):
            image = draw_cells(ax, values, grid.recorded, norm, cmap)
            if not by_bound:
                cross_out_of_tolerance(ax, grid.diverged & grid.recorded)
            label_heatmap_axes(ax, n_layers, labels, first=ax is axes[0])
            outline_first_divergence(ax, summary, grid.columns)
            ax.set_title(title, loc="left", color="#444444", fontsize=8.5)
        heat_colorbar(fig, axes, image, by_bound)
        fig.suptitle(figure_title(fig, comparison_title(summary)), fontsize=11, fontweight="bold")
        # wrapped to the figure's width (about 15 characters an inch at this size): one panel is narrower
        legend = textwrap.fill(heat_legend(summary, by_bound), width=int(15 * fig.get_figwidth()))
        fig.supxlabel(legend, fontsize=8, color="#444444")
    return fig


def heat_scale(shown: list[np.ndarray], by_bound: bool):
    """The log colour scale every panel shares. Against the tolerance: from a decade under the
    smallest non-zero ratio (at most 1e-2, at least 1e-4) to at least 10, the bands at NEAR and 1.
    Against rel_l2 alone: from a decade under the smallest error to at least 1."""
    values = np.concatenate([v[np.isfinite(v)].ravel() for v in shown])
    positive = values[values > 0]
    if by_bound:
        low = 10.0 ** math.floor(math.log10(positive.min())) / 10 if positive.size else 1e-2
        low = min(max(low, 1e-4), 1e-2)
        high = max(10.0, float(values.max(initial=0.0)))
        return LogNorm(vmin=low, vmax=high), tolerance_cmap(low, high)
    low = floor_for(positive) if positive.size else DEFAULT_FLOOR
    return LogNorm(vmin=low, vmax=max(1.0, float(values.max(initial=0.0)))), \
        matplotlib.colormaps["YlOrRd"].with_extremes(bad=(0, 0, 0, 0))


def tolerance_cmap(low: float, high: float) -> ListedColormap:
    """Three bands on the log scale from `low` to `high`: blues in tolerance (under NEAR), yellows
    near it, reds out (over 1), each band light to dark."""
    n = 512
    at = [round(n * math.log(x / low) / math.log(high / low)) for x in (NEAR, 1.0)]
    sizes = [at[0], at[1] - at[0], n - at[1]]
    bands = [_ramp(HEAT_COLORS[name], size) for name, size in zip(("in", "near", "out"), sizes)]
    return ListedColormap(np.vstack(bands)).with_extremes(bad=(0, 0, 0, 0), over=HEAT_COLORS["out"][1])


def _ramp(colors: tuple[str, str], size: int) -> np.ndarray:
    start, end = (np.array(matplotlib.colors.to_rgba(c)) for c in colors)
    return start + np.linspace(0, 1, max(size, 0))[:, None] * (end - start)  # (size, 4)


def draw_cells(ax, values: np.ndarray, recorded: np.ndarray, norm, cmap):
    """One panel's cells: exact zeros at the bottom of the scale, inf/NaN at its top (labelled),
    unrecorded cells grey and hatched. The image's array holds the values as drawn."""
    broken = recorded & ~np.isfinite(values)
    drawn = np.where(values == 0, norm.vmin, values)
    drawn[broken] = norm.vmax
    ax.set_facecolor("#d9d9d9")
    image = ax.imshow(np.ma.masked_invalid(np.where(recorded, drawn, np.nan)), cmap=cmap, norm=norm,
                      aspect="auto", interpolation="nearest")
    hatch_missing(ax, recorded)
    label_non_finite(ax, values, broken)
    return image


def cross_out_of_tolerance(ax, cells: np.ndarray) -> None:
    rows, cols = np.nonzero(cells)
    ax.plot(cols, rows, ls="none", marker="x", ms=4, color="black", mew=0.8)


def hatch_missing(ax, recorded: np.ndarray) -> None:
    for row, col in zip(*np.nonzero(~recorded)):
        ax.add_patch(Rectangle((col - 0.5, row - 0.5), 1, 1, fill=False, hatch="///",
                               ec="#9e9e9e", lw=0))


def label_non_finite(ax, grid: np.ndarray, cells: np.ndarray) -> None:
    """inf/NaN cells take the top colour; the word says which one it was."""
    for row, col in zip(*np.nonzero(cells)):
        ax.text(col, row, "nan" if np.isnan(grid[row, col]) else "inf", ha="center", va="center",
                fontsize=7, color="white", fontweight="bold")


def label_heatmap_axes(ax, n_layers: int, labels: list[str], first: bool = True) -> None:
    ax.set_xticks(range(len(labels)), labels, rotation=50, ha="right", rotation_mode="anchor", fontsize=7.5)
    step = max(1, math.ceil(n_layers / 30))
    ax.set_yticks(range(0, n_layers, step))
    ax.tick_params(axis="y", labelsize=7.5)
    if first:
        ax.set_ylabel("layer")
    # thin white lines between cells keep neighbouring equal colours apart (two line collections:
    # minor ticks as grid lines made a Tick object per line, a fifth of the figure's drawing time)
    ax.vlines(np.arange(-0.5, len(labels)), -0.5, n_layers - 0.5, color="white", lw=0.5)
    ax.hlines(np.arange(-0.5, n_layers), -0.5, len(labels) - 0.5, color="white", lw=0.5)


def heat_colorbar(fig: Figure, axes, image, by_bound: bool) -> None:
    """One colour bar for the panels; against the tolerance it names its bands beside them."""
    bar = fig.colorbar(image, ax=list(axes), pad=0.015, fraction=0.04, aspect=30)
    if not by_bound:
        bar.set_label("relative L2 (log scale)")
        return
    bar.set_label("error ÷ its own tolerance (log scale)")
    low, high = image.norm.vmin, image.norm.vmax
    for level, style in ((NEAR, "--"), (1.0, "-")):
        bar.ax.axhline(level, color="black", lw=1.4, ls=style)
    middles = {"in": math.sqrt(low * NEAR), "near": math.sqrt(NEAR), "out": math.sqrt(high)}
    for name, y in middles.items():
        bar.ax.text(-0.25, y, name, transform=bar.ax.get_yaxis_transform(), ha="right", va="center",
                    fontsize=7.5, rotation=90, color="#333333")


def heat_legend(summary: Summary, by_bound: bool) -> str:
    first = (summary.get("first_divergence") or {}).get("point")
    parts = (["blue: in tolerance · yellow: near it (over ¼ of it) · red: out"] if by_bound else
             ["x: out of tolerance (elementwise criterion)"])
    parts += ["exact 0: the lightest colour", "grey hatched: not recorded"]
    if first:
        parts.append(f"outlined: the first divergence, {first}")
    return plain(" · ".join(parts))


def outline_first_divergence(ax, summary: Summary, columns: list[str]) -> None:
    """A frame around the first divergence's cell, drawn on its border: no cell is covered."""
    first = summary.get("first_divergence") or {}
    layer = first.get("layer")
    sub = split_point(first.get("point", ""))[1]
    if layer is None or sub not in columns:
        return
    col = columns.index(sub)
    ax.add_patch(Rectangle((col - 0.5, layer - 0.5), 1, 1, fill=False, ec="black", lw=2.2, clip_on=False,
                           zorder=5))


# --- the first divergence, per position and per head ------------------------------------------

METRIC_LABELS = {"max_abs": "max |cand − ref|", "rel_l2": "relative L2"}
MAX_TOKEN_LABELS = 40  # beyond this many tokens the x axis shows indices only


def has_breakdown(summary) -> bool:
    return bool(breakdowns(as_summary(summary)))


def breakdown_figure(summary) -> Figure:
    """Where inside the first diverging tensor the error sits: per token (and per head).

    Bars of the per-position values (x labelled with the token texts when the run had them) and,
    for attention points, of the per-head values, as the diff engine stored them in
    `first_divergence["by_position"]` / `["by_head"]`. A result without them draws a figure that
    says so rather than failing.

    Args:
        summary: a `Result` or its summary dict.
    Returns:
        A Figure on an Agg canvas.
    """
    summary = as_summary(summary)
    parts = breakdowns(summary)
    first = summary.get("first_divergence") or {}
    with matplotlib.rc_context(STYLE):
        fig = new_figure((10.5, 3.5))
        if not parts:
            reason = ("the result has no per-position breakdown of its first divergence" if first
                      else summary.get("error") or "nothing diverged")
            return empty_figure(fig, {**summary, "error": reason})
        head_width = max(3, len(parts["by_head"]) * 0.8) if "by_head" in parts else 0
        # the per-position panel carries the main message: never narrower than the heads'
        widths = [max(5, len(parts["by_position"]), 1.4 * head_width) if "by_position" in parts else 0,
                  head_width]
        axes = fig.subplots(1, len(parts), width_ratios=[w for w in widths if w], squeeze=False)[0]
        metric = METRIC_LABELS.get(first.get("breakdown_metric", "max_abs"), str(first.get("breakdown_metric")))
        for ax, (key, values) in zip(axes, parts.items()):
            labels = position_labels(summary, len(values)) if key == "by_position" else head_labels(first, len(values))
            draw_bars(ax, as_array(values), labels)
            ax.set_ylabel(metric)
            ax.set_xlabel("token (position: text)" if key == "by_position" else head_axis(first))
            ax.set_title("per position" if key == "by_position" else "per head", loc="left", color="#444444")
        fig.suptitle(figure_title(fig, f"{comparison_title(summary)}\nfirst divergence: {first.get('point')}"),
                     fontsize=10.5, fontweight="bold")
    return fig


def position_labels(summary: Summary, n: int) -> list[str]:
    texts = summary.get("token_texts") or []
    if n > MAX_TOKEN_LABELS or len(texts) != n:
        step = max(1, math.ceil(n / MAX_TOKEN_LABELS))
        return [str(i) if i % step == 0 else "" for i in range(n)]
    # repr-like quoting shows leading spaces; long pieces are cut so the axis stays legible
    return [plain(f"{i}: {shorten(t)}") for i, t in enumerate(texts)]


def shorten(text: str, limit: int = 12) -> str:
    text = text.replace("\n", "\\n")
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    return f"'{text}'"


def is_kv_point(first: dict) -> bool:
    return split_point(str(first.get("point", "")))[1] in (K_PROJ, V_PROJ, K_ROPE)


def head_axis(first: dict) -> str:
    return "kv head" if is_kv_point(first) else "query head"


def head_labels(first: dict, n: int) -> list[str]:
    kind = "kv" if is_kv_point(first) else "q"
    return [f"{kind}{i}" for i in range(n)]


def draw_bars(ax, values: np.ndarray, labels: list[str]) -> None:
    """Bars on a linear axis (the shape of the growth is the message); exact zeros as open
    triangles on the baseline so a zero is not mistaken for a missing bar."""
    x = np.arange(len(values))
    finite = np.isfinite(values)
    ax.bar(x[finite], values[finite], color=COLORS["bad"], alpha=0.85, width=0.75)
    zero = values == 0
    if zero.any():
        ax.plot(x[zero], np.zeros(zero.sum()), ls="none", marker="^", ms=7, mfc="white",
                mec=COLORS["rel"], mew=1.4, clip_on=False, label="exact 0")
        ax.legend(loc="upper left")
    if (~finite).any():
        ax.plot(x[~finite], np.full((~finite).sum(), 0.93), ls="none", marker="^", ms=8,
                color=COLORS["bad"], transform=ax.get_xaxis_transform(), label="inf / NaN")
    rotate = max((len(lab) for lab in labels), default=0) > 3
    ax.set_xticks(x, labels, rotation=45 if rotate else 0, ha="right" if rotate else "center", fontsize=8)
    ax.set_xlim(-0.7, len(values) - 0.3)
    top = max(np.max(values[finite], initial=0.0) * 1.12, 1e-30)
    ax.set_ylim(-0.015 * top, top)  # the zero markers sit on the baseline, not half under it
    ax.grid(axis="x", visible=False)


ROUTING_LABELS = 400  # cells up to which the routing map writes each margin in its cell


def routing_figure(summary) -> Figure:
    """The routing map of a mixture of experts: one row per layer, one cell per token, coloured by what the
    candidate picked there (the reference's experts, the same in another order, others on a near-tie, others
    structurally), each cell labelled with the reference's margin between its k-th and (k+1)-th selection
    score where the map is small enough to read; the first structural flip outlined.

    Args:
        summary: a `Result` or its summary dict, with routing points (`routing`).
    Returns:
        A Figure on an Agg canvas; `fig.axes[0].images[0].get_array()` holds each cell's status as its
        index in `tracer.reports.routing_map.STATUS`, per (layer, token).
    """
    summary = as_summary(summary)
    routing = summary.get("routing") or {}
    layers = routing.get("layers") or []
    tokens = max((len(layer.get("status") or []) for layer in layers), default=0)
    codes = list(STATUS)
    grid = np.full((len(layers), tokens), np.nan)  # (layers, tokens): status index
    for row, layer in enumerate(layers):
        grid[row, :len(layer.get("status") or [])] = [codes.index(status) for status in layer.get("status") or []]
    with matplotlib.rc_context({**STYLE, "axes.grid": False}):
        fig = new_figure((min(14.0, max(6.0, 0.45 * tokens + 2.5)), min(12.0, max(2.6, 0.4 * len(layers) + 1.8))))
        if not layers:
            return empty_figure(fig, summary)
        ax = fig.subplots()
        cmap = ListedColormap([colour for colour, _, _ in STATUS.values()])
        ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=-0.5, vmax=len(codes) - 0.5, aspect="auto",
                  interpolation="nearest")
        if grid.size <= ROUTING_LABELS:
            for row, layer in enumerate(layers):
                for token, margin in enumerate(layer.get("margin") or []):
                    ax.text(token, row, fmt(margin), ha="center", va="center", fontsize=6.5, color="#222222")
        first = routing.get("first_structural")
        if first:
            row = next(i for i, layer in enumerate(layers) if layer["layer"] == first["layer"])
            ax.add_patch(Rectangle((first["token"] - 0.5, row - 0.5), 1, 1, fill=False, ec="#222222", lw=2))
        ax.set_yticks(range(len(layers)), [str(layer["layer"]) for layer in layers])
        step = max(1, math.ceil(tokens / 40))
        ax.set_xticks(range(0, tokens, step))
        ax.set_xlabel("token")
        ax.set_ylabel("layer")
        present = [code for code in codes if np.any(grid == codes.index(code))]
        ax.legend(handles=[Rectangle((0, 0), 1, 1, fc=STATUS[code][0], ec="#888888",
                                     label=code.replace("_", "-")) for code in present],
                  loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7.5, frameon=False)
        fig.suptitle(figure_title(fig, comparison_title(summary)), fontsize=11, fontweight="bold")
        fig.supxlabel(textwrap.fill(routing_line(summary) or "", width=int(15 * fig.get_figwidth())), fontsize=8,
                      color="#444444")
    return fig


def draw_images(summary, names: tuple[str, ...] = FIGURES) -> dict[str, bytes]:
    """PNG bytes by file name of those of `names` the summary has (a breakdown only where the first
    divergence carries one), in the report's order; a failed run's figures say why."""
    summary = as_summary(summary)
    draw = {"curve.png": curve_figure, "breakdown.png": breakdown_figure, "heatmap.png": layer_heatmap_figure,
            "routing.png": routing_figure}
    return {name: figure_png(draw[name](summary)) for name in figure_names(summary) if name in names}
