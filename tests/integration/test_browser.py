"""The report of `tracer run --variant theta=10000` on the bundled SmolLM2, as a maintainer gets it.

The files are checked as text (first divergence named, user text escaped, nothing remote) and
report.html is opened in headless Chromium (Debian's `chromium`, installed by .ci/run): the
verdict is on the page, every figure decodes, the table sorts, and the prompt's script tag stays
text. Outside CI a machine without Chromium skips the browser part; in CI it must run.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess

import numpy as np
import pytest
from matplotlib import image as mpimg

import tracer

HOSTILE_PROMPT = 'Paris <script>alert(1)</script> & "q"'
FIRST = "model.layers.0.self_attn.q_rope"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]

# Runs after the page's own script: reports what a reader would see as attributes on <body>.
PROBE = """<script>
window.addEventListener("load", function () {
  var body = document.body, imgs = Array.from(document.images);
  var loaded = imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; });
  body.setAttribute("data-images", loaded.length + "/" + imgs.length);
  var banner = document.querySelector(".banner");
  body.setAttribute("data-banner", banner.getBoundingClientRect().height > 0 ? banner.innerText : "");
  body.setAttribute("data-scripts", document.scripts.length);
  var th = Array.from(document.querySelectorAll("#points thead th"))
    .find(function (h) { return h.textContent.trim() === "rel_l2"; });
  th.click(); th.click();  // ascending, then descending
  body.setAttribute("data-top-rel", document.querySelector("#points tbody tr td.point").textContent);
});
</script>"""


@pytest.fixture(scope="module")
def report(default_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("browser") / "report"
    result = tracer.run(default_model, HOSTILE_PROMPT, variant="theta=10000", out=folder, progress=False)
    return result, folder


@pytest.fixture(scope="module")
def chromium():
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed; .ci/run installs Debian's chromium package")
        pytest.skip("chromium is not installed (apt-get install chromium); CI runs this test")
    return CHROMIUM


def headless(chromium: str, tmp_path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / "profile"
    return subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=120, check=True)


def test_html_and_markdown_name_the_first_divergence(report):
    result, folder = report
    assert result.first_divergence.point == FIRST
    page = (folder / "report.html").read_text(encoding="utf-8")
    markdown = (folder / "summary.md").read_text(encoding="utf-8")
    assert f"the first divergence is {FIRST}" in page
    assert f"| first divergence | {FIRST} |" in markdown
    assert "tracer: DIVERGED" in markdown and "![per-layer error curve](curve.png)" in markdown
    assert len(markdown) < 10_000  # a GitHub comment holds 65,536 characters; this one stays short


def test_user_text_is_escaped_and_nothing_is_remote(report):
    _, folder = report
    page = (folder / "report.html").read_text(encoding="utf-8")
    markdown = (folder / "summary.md").read_text(encoding="utf-8")
    assert "Paris &lt;script&gt;alert(1)&lt;/script&gt; &amp; &#34;q&#34;" in page
    assert "<script>alert(1)" not in page and page.count("<script>") == 1  # the sort script only
    assert not re.search(r"https?://", page)
    assert "<link" not in page and "@import" not in page and "url(" not in page
    prose = markdown.split("```sh")[0]  # the reproduce block shows the command literally
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in prose and "<script>" not in prose


def test_every_png_is_a_real_figure(report):
    _, folder = report
    names = sorted(p.name for p in folder.glob("*.png"))
    assert names == ["breakdown.png", "curve.png", "heatmap.png"]
    for name in names:
        pixels = mpimg.imread(io.BytesIO((folder / name).read_bytes()), format="png")
        height, width = pixels.shape[:2]
        assert 900 <= width <= 1600 and 400 <= height <= 1600, name
        rgb = (pixels[..., :3] * 255).astype(np.uint8).reshape(-1, 3)
        colours = np.unique(rgb, axis=0)
        assert len(colours) > 50, f"{name} is nearly blank"
        # the out-of-tolerance red of the markers and bars (#c62828, drawn with some alpha on bars)
        red = (rgb[:, 0] > 180) & (rgb[:, 1] < 90) & (rgb[:, 2] < 90)
        assert red.sum() > 200, f"{name} shows no divergence"


def test_chromium_shows_the_verdict_and_every_image(report, chromium, tmp_path):
    result, folder = report
    page = (folder / "report.html").read_text(encoding="utf-8")
    probed = tmp_path / "report.html"
    probed.write_text(page.replace("</body>", PROBE + "\n</body>"), encoding="utf-8")
    dom = headless(chromium, tmp_path, "--virtual-time-budget=10000", "--dump-dom", probed.as_uri()).stdout
    body = re.search(r"<body([^>]*)>", dom).group(1)
    attributes = dict(re.findall(r'data-([a-z-]+)="([^"]*)"', body))
    assert attributes["images"] == "3/3"
    assert attributes["banner"].startswith("DIVERGED") and FIRST in attributes["banner"]
    assert attributes["scripts"] == "2"  # ours and the probe: the prompt's <script> stayed text
    worst = max((p for p in result.points if p.rel_l2 is not None), key=lambda p: p.rel_l2)
    assert attributes["top-rel"] == worst.point
    assert "Paris &lt;script&gt;alert(1)&lt;/script&gt;" in dom  # shown as text in the page


def test_chromium_screenshot_shows_the_red_banner(report, chromium, tmp_path):
    _, folder = report
    shot = tmp_path / "shot.png"
    headless(chromium, tmp_path, "--window-size=1200,900", f"--screenshot={shot}",
             (folder / "report.html").as_uri())
    pixels = (mpimg.imread(shot)[..., :3] * 255).astype(int)
    banner = (abs(pixels[..., 0] - 0xC6) < 8) & (abs(pixels[..., 1] - 0x28) < 8) & (abs(pixels[..., 2] - 0x28) < 8)
    rows = np.nonzero(banner.any(axis=1))[0]
    assert banner.sum() > 20_000 and rows.min() < 200  # a wide red block near the top
