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

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import ListedColormap, LogNorm
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from ..points import EMBED, FINAL_NORM, LAYER_POINTS, LOGITS, is_coarse, layer_of
from .summary import (
    Summary, as_summary, comparison_title, fmt, number, points, rel_l2_threshold, tolerance_text,
)

DPI = 110
CURVE_SIZE = (10.5, 6.0)  # inches
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

COARSE_LABELS = {EMBED: "embed", FINAL_NORM: "norm", LOGITS: "logits"}
# Column labels of the heatmap, one per entry of LAYER_POINTS.
SUB_LABELS = (
    "in_norm", "q_proj", "k_proj", "v_proj", "q_rope", "k_rope", "scores", "probs", "context",
    "o_proj", "resid_mid", "post_norm", "gate", "up", "act", "down", "block out",
)


def plain(text: str) -> str:
    """User text for a matplotlib label: a '$' would otherwise switch on mathtext."""
    return text.replace("$", r"\$")


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
    if point in COARSE_LABELS:
        return COARSE_LABELS[point]
    return str(layer_of(point))


def coarse_x(coarse: list[dict]) -> np.ndarray:
    """x positions: blocks at their index; embed, norm and logits set apart by a small gap."""
    xs, block = [], 0
    for p in coarse:
        if p["point"] == EMBED:
            xs.append(-1.5)
        elif p["point"] == FINAL_NORM:
            xs.append(block + 0.5)
        elif p["point"] == LOGITS:
            xs.append(block + 2.0)
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
        floor = floor_for(rel, below=threshold)
        missing = missing_mask(coarse, "rel_l2")
        plot_series(top, x, rel, missing, diverged, floor, COLORS["rel"], "relative L2  ‖cand − ref‖ / ‖ref‖")
        set_log_limits(top, floor, rel)
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
    ax.set_yscale("log")
    ax.set_ylim(floor / 4, max(peak, floor * 10) * 100)  # headroom above for the annotation


def add_tolerance(ax, threshold: float | None) -> None:
    if threshold is None:
        return
    ax.axhline(threshold, color=COLORS["tol"], ls=":", lw=1.6, label=f"tolerance (rel_l2 {threshold:.0e})")
    low, high = ax.get_ylim()
    high = max(high, threshold * 30)
    ax.axhspan(threshold, high, color=COLORS["bad"], alpha=0.05, lw=0, zorder=0)  # out of tolerance
    ax.set_ylim(low, high)


def set_coarse_ticks(ax, coarse: list[dict], x: np.ndarray) -> None:
    """Every label up to ~40 ticks; beyond that every k-th block, always embed/norm/logits."""
    labels = [coarse_label(p["point"]) for p in coarse]
    step = max(1, math.ceil(len(labels) / 40))
    shown = [
        lab if (i % step == 0 or lab in COARSE_LABELS.values()) else "" for i, lab in enumerate(labels)
    ]
    ax.set_xticks(x, shown, fontsize=8)
    ax.set_xlim(x.min() - 0.7, x.max() + 0.7)


def divergence_x(first: dict, coarse: list[dict], x: np.ndarray) -> float | None:
    """x of the coarse point that contains the first divergence (its block's output)."""
    names = [p["point"] for p in coarse]
    layer = first.get("layer")
    target = f"model.layers.{layer}" if layer is not None else first.get("point")
    return float(x[names.index(target)]) if target in names else None


def mark_first_divergence(axes, summary: Summary, coarse: list[dict], x: np.ndarray) -> None:
    first = summary.get("first_divergence")
    at = divergence_x(first, coarse, x) if first else None
    if at is None:
        return
    for ax in axes:
        ax.axvline(at, color=COLORS["bad"], ls="--", lw=1.2, alpha=0.8)
    where = "" if first.get("layer") is None else f"block {first['layer']}, "
    text = f"first divergence: {first['point']}  ({where}rel_l2 {fmt(first.get('rel_l2'), '.2g')})"
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
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    # measurements first, then reference lines, then marker meanings
    rank = ("relative", "max |cand", "max |ref", "tolerance", "out of", "exact", "not rec")
    order = sorted(entries, key=lambda lab: next((i for i, r in enumerate(rank) if lab.startswith(r)), 99))
    entries = {label: entries[label] for label in order}
    fig.legend(entries.values(), entries.keys(), loc="outside lower center",
               ncols=min(len(entries), 4), frameon=False)


def set_titles(fig: Figure, ax, summary: Summary) -> None:
    fig.suptitle(plain(comparison_title(summary)), fontsize=11, fontweight="bold")
    verdict = str(summary.get("verdict", "?")).upper()
    ax.set_title(plain(f"{verdict}   ·   fails when {tolerance_text(summary)}"), loc="left",
                 color="#444444")


def empty_figure(fig: Figure, summary: Summary) -> Figure:
    """What a run without points (a failed run) draws: the reason, in place of a curve."""
    reason = summary.get("error") or "no points were compared"
    fig.suptitle(plain(comparison_title(summary)), fontsize=11, fontweight="bold")
    fig.text(0.5, 0.5, plain(f"Nothing to plot.\n{reason}"), ha="center", va="center",
             fontsize=11, color="#555555", wrap=True)
    return fig


# --- the layer × sub-point heatmap -----------------------------------------------------------


def layer_grid(summary: Summary) -> tuple[np.ndarray, np.ndarray]:
    """rel_l2 per (layer, sub-point) (inf/NaN kept) and the mask of cells that were recorded."""
    layered = [p for p in points(summary) if p.get("layer") is not None]
    n_layers = max((p["layer"] for p in layered), default=-1) + 1
    grid = np.full((n_layers, len(LAYER_POINTS)), np.nan)
    recorded = np.zeros(grid.shape, dtype=bool)
    for p in layered:
        sub = p["point"].removeprefix(f"model.layers.{p['layer']}").lstrip(".")
        value = number(p.get("rel_l2"))
        if sub in LAYER_POINTS and value is not None:
            cell = p["layer"], LAYER_POINTS.index(sub)
            grid[cell], recorded[cell] = value, True
    return grid, recorded


def layer_heatmap_figure(summary) -> Figure:
    """rel_l2 of every sub-point of every layer, log colour scale; unrecorded cells hatched grey."""
    summary = as_summary(summary)
    grid, recorded = layer_grid(summary)
    height = min(14.0, max(3.6, 0.17 * grid.shape[0] + 2.2))
    with matplotlib.rc_context({**STYLE, "axes.grid": False}):
        fig = new_figure((10, height))
        if not recorded.any():
            return empty_figure(fig, summary)
        ax = fig.subplots()
        threshold = rel_l2_threshold(summary)
        floor = floor_for(grid, below=threshold)
        finite = np.isfinite(grid)
        # a fixed top of 1 (rel_l2 ~1 means "unrelated tensors") keeps a clean run from looking hot
        vmax = max(np.max(grid[finite], initial=floor), 1.0)
        shown = np.where(grid == 0, floor, grid)
        shown[recorded & ~finite] = vmax  # inf / NaN: as bad as it gets
        shown[~recorded] = np.nan
        image = ax.imshow(np.ma.masked_invalid(shown), cmap=error_cmap(floor, vmax, threshold),
                          aspect="auto", norm=LogNorm(vmin=floor, vmax=vmax), interpolation="nearest")
        hatch_missing(ax, recorded)
        label_non_finite(ax, grid, recorded & ~finite)
        label_heatmap_axes(ax, grid.shape[0])
        colorbar(fig, ax, image, summary)
        outline_first_divergence(ax, summary)
        fig.suptitle(plain(comparison_title(summary)), fontsize=11, fontweight="bold")
        ax.set_title(f"relative L2 per layer and sub-point · grey hatched: not recorded · "
                     f"exact 0 shown as {floor:.0e}", loc="left", color="#444444")
    return fig


def error_cmap(floor: float, vmax: float, threshold: float | None):
    """Cool blues under the tolerance, YlOrRd above it: in or out reads at a glance."""
    warm = matplotlib.colormaps["YlOrRd"]
    if threshold is None or not floor < threshold < vmax:
        return warm.with_extremes(bad="#d9d9d9")
    n = 256
    cut = round(n * math.log(threshold / floor) / math.log(vmax / floor))
    cool = matplotlib.colormaps["Blues"](np.linspace(0.08, 0.45, cut))
    hot = warm(np.linspace(0.3, 1.0, n - cut))
    return ListedColormap(np.vstack([cool, hot])).with_extremes(bad="#d9d9d9")


def hatch_missing(ax, recorded: np.ndarray) -> None:
    for row, col in zip(*np.nonzero(~recorded)):
        ax.add_patch(Rectangle((col - 0.5, row - 0.5), 1, 1, fill=False, hatch="///",
                               ec="#9e9e9e", lw=0))


def label_non_finite(ax, grid: np.ndarray, cells: np.ndarray) -> None:
    """inf/NaN cells take the top colour; the word says which one it was."""
    for row, col in zip(*np.nonzero(cells)):
        ax.text(col, row, "nan" if np.isnan(grid[row, col]) else "inf", ha="center", va="center",
                fontsize=7.5, color="white", fontweight="bold")


def label_heatmap_axes(ax, n_layers: int) -> None:
    ax.set_xticks(range(len(SUB_LABELS)), SUB_LABELS, rotation=40, ha="right", fontsize=8)
    step = max(1, math.ceil(n_layers / 40))
    ax.set_yticks(range(0, n_layers, step))
    ax.tick_params(axis="y", labelsize=8)
    ax.set_ylabel("layer")
    # thin white lines between cells keep neighbouring equal colours apart
    ax.set_xticks(np.arange(-0.5, len(SUB_LABELS)), minor=True)
    ax.set_yticks(np.arange(-0.5, n_layers), minor=True)
    ax.grid(which="minor", color="white", lw=0.6)
    ax.tick_params(which="minor", length=0)


def colorbar(fig: Figure, ax, image, summary: Summary) -> None:
    bar = fig.colorbar(image, ax=ax, pad=0.02, fraction=0.05)
    bar.set_label("relative L2 (log scale)")
    threshold = rel_l2_threshold(summary)
    low, high = image.norm.vmin, image.norm.vmax
    if threshold is not None and low <= threshold <= high:
        bar.ax.axhline(threshold, color="black", lw=2)
        bar.ax.text(-0.15, threshold, "tol", transform=bar.ax.get_yaxis_transform(),
                    ha="right", va="center", fontsize=8)


def outline_first_divergence(ax, summary: Summary) -> None:
    first = summary.get("first_divergence") or {}
    layer = first.get("layer")
    if layer is None:
        return
    sub = first["point"].removeprefix(f"model.layers.{layer}").lstrip(".")
    if sub not in LAYER_POINTS:
        return
    col = LAYER_POINTS.index(sub)
    ax.add_patch(Rectangle((col - 0.5, layer - 0.5), 1, 1, fill=False, ec="black", lw=2.5, clip_on=False))
    ax.annotate(plain(f"first divergence: {first['point']}"), xy=(col, layer),
                xytext=(12, -4), textcoords="offset points", fontsize=8, color="black",
                va="top", bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": "black"})
