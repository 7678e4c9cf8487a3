"""The report of `tracer run --variant theta=10000` on the bundled SmolLM2, as a porting engineer reads it.

report.html is opened in headless Chromium (Debian's `chromium`, installed by .ci/run) at 1400 × 900
px, and what is checked is read from the rendered page, not from the HTML source: the verdict, the
first divergence, the hint and the curve on the first screen; the page's height with the points
table collapsed; no horizontal scroll; every image decoded; the full table sorting and filtering.
The same report rendered from a summary full of hostile text runs no script but ours. Outside CI
a machine without Chromium skips the browser part (saying why); in CI it must run.

Cost: one `tracer run` of the main job (its noise floor and greedy reference usually cached by the
other SmolLM2 tests) and four Chromium page loads, about 20 s.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess

import numpy as np
import pytest
from matplotlib import image as mpimg

import tracer
from tracer.reports import layer_heatmap_figure, write_report

FIRST = "model.layers.0.self_attn.q_rope"
HOSTILE = '<script>alert(1)</script><img src=x onerror=alert(2)> & "q"'
WIDTH, SCREEN, MAX_HEIGHT = 1400, 900, 4000
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]

# Runs after the page's own script: what a reader sees, written as attributes on <body> (--dump-dom).
PROBE = """<script>
window.addEventListener("load", function () {
  var body = document.body, root = document.documentElement;
  function put(key, value) { body.setAttribute("data-" + key, value); }
  function bottom(element) { return element ? Math.round(element.getBoundingClientRect().bottom) : -1; }
  var imgs = Array.from(document.images);
  put("images", imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length + "/" + imgs.length);
  put("height", root.scrollHeight);
  put("overflow", root.scrollWidth - root.clientWidth);
  put("scripts", document.scripts.length);
  var banner = document.querySelector(".banner");
  put("banner", banner.innerText.split("\\n")[0]);
  put("banner-bottom", bottom(banner));
  var first = Array.from(banner.querySelectorAll("p")).find(function (p) {
    return p.textContent.indexOf("%(first)s") >= 0; });
  put("first-bottom", bottom(first));
  var hint = banner.querySelector("ul.hints li");
  put("hint", hint ? hint.textContent : "");
  put("hint-bottom", bottom(hint));
  var curve = document.getElementById("curve");
  put("curve-bottom", bottom(curve));
  put("curve-width", curve ? curve.naturalWidth : 0);
  put("next-bottom", bottom(document.getElementById("next")));
  put("all-open", document.getElementById("all").open ? "yes" : "no");
  put("nav", Array.from(document.querySelectorAll("nav a")).map(function (a) {
    return a.getAttribute("href"); }).join(" "));
  var table = document.getElementById("all-points");
  var th = Array.from(table.querySelectorAll("thead th")).find(function (h) {
    return h.textContent.trim() === "rel_l2"; });
  th.click(); th.click();  // ascending, then descending
  put("top-rel", table.tBodies[0].rows[0].cells[1].textContent);
  var filter = document.getElementById("filter-text");
  filter.value = "q_rope"; filter.dispatchEvent(new Event("input"));
  put("q-rope-rows", Array.from(table.tBodies[0].rows).filter(function (r) { return !r.hidden; }).length);
});
</script>""" % {"first": FIRST}


@pytest.fixture(scope="module")
def report(default_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("browser") / "report"
    result = tracer.run(default_model, variant="theta=10000", out=folder, progress=False)
    return result, folder


@pytest.fixture(scope="module")
def hostile_report(report, tmp_path_factory):
    """The same report with user text that tries to run script everywhere a user's words appear."""
    _, folder = report
    summary = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
    summary["prompt"] = f"Paris {HOSTILE}"
    summary["model"] = f"/models/{HOSTILE}"
    summary["command"] = f"tracer run --prompt '{HOSTILE}'"
    summary["token_texts"][1] = HOSTILE
    summary["greedy"]["candidate_text"] += HOSTILE
    summary["notes"] = [*summary["notes"], HOSTILE]
    summary["candidate"]["variant"]["rope"] = HOSTILE
    summary["first_divergence"]["hints"] = [HOSTILE]
    return write_report(summary, tmp_path_factory.mktemp("hostile") / "report")


@pytest.fixture(scope="module")
def chromium():
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed; .ci/run installs Debian's chromium package")
        pytest.skip("chromium is not installed (apt-get install chromium); CI runs this test")
    return CHROMIUM


def headless(chromium: str, tmp_path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / "profile"
    return subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                           f"--window-size={WIDTH},{SCREEN}", *args],
                          capture_output=True, text=True, timeout=120, check=True)


def rendered(chromium: str, folder, tmp_path) -> dict[str, str]:
    """What the probe measured on the rendered report.html."""
    page = (folder / "report.html").read_text(encoding="utf-8")
    probed = tmp_path / "report.html"
    probed.write_text(page.replace("</body>", PROBE + "\n</body>"), encoding="utf-8")
    dom = headless(chromium, tmp_path, "--virtual-time-budget=10000", "--dump-dom", probed.as_uri()).stdout
    body = re.search(r"<body([^>]*)>", dom).group(1)
    return dict(re.findall(r'data-([a-z-]+)="([^"]*)"', body)) | {"dom": dom}


def test_the_first_screen_answers_and_the_page_fits(report, chromium, tmp_path):
    result, folder = report
    seen = rendered(chromium, folder, tmp_path)
    assert seen["banner"].startswith("DIVERGED")
    for what in ("banner", "first", "hint", "curve", "next"):  # inside the first 1400 × 900 px
        assert 0 < int(seen[f"{what}-bottom"]) <= SCREEN, (what, seen[f"{what}-bottom"])
    assert "positional encoding" in seen["hint"] and int(seen["curve-width"]) > 800
    assert seen["all-open"] == "no" and int(seen["height"]) <= MAX_HEIGHT  # measured 3813 px
    assert int(seen["overflow"]) <= 0  # no horizontal scroll at 1400 px
    assert seen["images"] == "3/3"
    assert {"#audit", "#reproduce", "#environment", "#points"} <= set(seen["nav"].split())
    worst = max((p for p in result.points if p.rel_l2 is not None), key=lambda p: p.rel_l2)
    assert seen["top-rel"] == worst.point  # the full table sorts
    assert seen["q-rope-rows"] == "30"  # ... and filters: one q_rope per layer


def test_hostile_text_stays_text(hostile_report, chromium, tmp_path):
    page = (hostile_report / "report.html").read_text(encoding="utf-8")
    assert "<script>alert" not in page and "<img src=x" not in page and page.count("<script>") == 1
    assert not re.search(r"https?://", page) and "<link" not in page and "@import" not in page
    seen = rendered(chromium, hostile_report, tmp_path)
    assert seen["scripts"] == "2"  # ours and the probe
    assert seen["images"] == "3/3"  # the <img src=x> stayed text: no broken image
    assert "Paris &lt;script&gt;alert(1)&lt;/script&gt;" in seen["dom"]


def test_the_local_error_view_shows_q_rope_making_the_error_in_every_layer(report):
    """Read from the figure's data: each cell is its local error over its own tolerance."""
    result, _ = report
    local_panel = layer_heatmap_figure(result).axes[0]
    labels = [t.get_text() for t in local_panel.get_xticklabels()]
    ratio = local_panel.images[0].get_array()
    assert ratio.shape[0] == 30 and labels[:5] == ["in_norm", "q_proj", "k_proj", "v_proj", "q_rope"]
    assert (ratio[:, :4] <= 1).all()  # the norm and projections: within tolerance in every layer
    assert (ratio[:, 4] > 1).all()  # q_rope makes the error, in every layer


def test_markdown_and_every_png(report):
    result, folder = report
    markdown = (folder / "summary.md").read_text(encoding="utf-8")
    assert f"| first divergence | {FIRST} |" in markdown and "| error made there | rel_l2 0.0805, " in markdown
    assert "tracer: DIVERGED" in markdown and "![per-layer error curve](curve.png)" in markdown
    assert len(markdown) < 10_000  # a GitHub comment holds 65,536 characters; this one stays short
    names = sorted(p.name for p in folder.glob("*.png"))
    assert names == ["breakdown.png", "curve.png", "heatmap.png"]
    for name in names:
        pixels = mpimg.imread(io.BytesIO((folder / name).read_bytes()), format="png")
        height, width = pixels.shape[:2]
        assert 900 <= width <= 1272 and 350 <= height <= 900, name  # within the page's 1272 px
        rgb = (pixels[..., :3] * 255).astype(np.uint8).reshape(-1, 3)
        assert len(np.unique(rgb, axis=0)) > 50, f"{name} is nearly blank"
        red = (rgb[:, 0] > 150) & (rgb[:, 1] < 90) & (rgb[:, 2] < 90)
        assert red.sum() > 200, f"{name} shows no divergence"


def test_the_screenshot_shows_the_red_banner_at_the_top(report, chromium, tmp_path):
    _, folder = report
    shot = tmp_path / "shot.png"
    headless(chromium, tmp_path, f"--screenshot={shot}", (folder / "report.html").as_uri())
    pixels = (mpimg.imread(shot)[..., :3] * 255).astype(int)
    banner = (abs(pixels[..., 0] - 0xC6) < 8) & (abs(pixels[..., 1] - 0x28) < 8) & (abs(pixels[..., 2] - 0x28) < 8)
    rows = np.nonzero(banner.any(axis=1))[0]
    assert banner.sum() > 20_000 and rows.min() < 200  # a wide red block near the top
