"""Every knob of `tracer variants` runs on every family it applies to, generated from the catalogue
(`tracer.model.knobs.knobs_for`, which reads each component's knobs) on the tiny families of
tests/families.py: per family one sweep on the reimplementation (the engine that honours every knob but
a runtime's own switches) with one representative value of each knob and the greedy check, a decode
sweep of the decode-only knobs (`tracer.model.kv_cache.KNOBS`) past the window, and one padded batch
per batch-only knob (`tracer.model.components.padding.KNOBS`).

The rule a cell is held to: it passes when its row has a verdict (`match` or `diverged`: what the knob
finds is not this test's business), or when its error is a documented refusal, which is

- one line of at most 100 columns that begins with one of the variant's own `knob=value` pairs: how a
  knob says that this model has nothing for it to change, or that it cannot apply here
  (`ring_index=fill changes nothing here: this model's config has no sliding window`); or
- for a config knob (one that makes the config disagree with the weights: `layers`, `head_dim`), the one
  line the load gives, naming the weight (`missing tensor ...`, `shape mismatch, ....weight`): that
  error is what the knob reproduces.

Anything else fails the cell: an exception out of the sweep (a crash, a traceback), an error naming a
point of the comparison (`shape mismatch at model.layers.0.self_attn.cache_k`), any other text.

Knobs not run here: a runtime's own switches (`ort_opt`, `threads`, `n_ubatch`; kind `runtime`), which
no in-process engine honours on every family (onnx, llama.cpp and candle have their own tests). A knob
that takes a GGUF's tensors (`weights=gguf`, with `gguf_file`, `requantize`) is given the family's GGUF,
written by tests/tiny_gguf.py (the families whose GGUF is a Llama's: the only ones those knobs apply to).
The models are 64 wide (head size 16) so that every row is whole blocks of ggml's formats."""

from __future__ import annotations

import re
import time

import pytest

import tracer
from tests.families import TINY_FAMILIES, WINDOW, write_tiny_family
from tests.tiny_gguf import write_tiny_gguf
from tracer.core.errors import TracerError
from tracer.engines.registry import ENGINES
from tracer.model import kv_cache
from tracer.model.component import family_named
from tracer.model.components import padding
from tracer.model.config import load_config, read_hf
from tracer.model.families import FAMILIES
from tracer.model.knobs import KNOBS, knobs_for, llama_gguf, parse_variant, variant_text

PROMPT = [3, 4, 5, 6, 7, 8]  # longer than the window: windows, rings and masks have something to do
ROWS = [PROMPT, [9, 10, 11]]  # a padded batch: the second row left-padded
DECODE, GREEDY = 2, 3
LOAD_ERROR = re.compile(r"^(missing tensor|shape mismatch,) \S+\.(weight|bias)\b")


def refusal(variant: dict, error: str) -> bool:
    """The rule of the module docstring: a documented one-line refusal, or a config knob's load error."""
    if "\n" in error or len(error) > 100:
        return False
    if any(error.startswith(pair) for pair in variant_text(variant).split(",")):
        return True
    return any(KNOBS[knob].kind == "config" for knob in variant) and bool(LOAD_ERROR.match(error))


def representatives(family: str, spec, gguf) -> dict[str, list[dict]]:
    """One variant per knob that applies to `family` and that the reimplementation honours (its
    representative on this model, else the value `tracer variants` shows), by what runs it: the plain
    sweep, the decode sweep, a padded batch."""
    decode_only = {knob.name for knob in kv_cache.KNOBS}
    batch_only = {knob.name for knob in padding.KNOBS}
    runs: dict[str, list[dict]] = {"sweep": [], "decode": [], "batch": []}
    for knob in knobs_for(family):
        if not ENGINES["reimpl"].honours(knob.name):
            continue
        variant = parse_variant(knob.representative(spec) or knob.representative(None))
        if variant.get("weights") == "gguf":  # the family's own GGUF, where the placeholder names model.gguf
            variant["gguf_file"] = str(gguf)
        runs["decode" if knob.name in decode_only else "batch" if knob.name in batch_only else "sweep"].append(variant)
    return runs


@pytest.fixture(scope="module")
def timings():
    """Per family: (knob × family cells, seconds), printed at the end (`pytest -s`)."""
    ran: dict[str, tuple[int, float]] = {}
    yield ran
    print(f"\ncatalogue: {sum(n for n, _ in ran.values())} cells, {sum(s for _, s in ran.values()):.1f} s "
          f"({', '.join(f'{family} {n} in {s:.1f} s' for family, (n, s) in ran.items())})")


def test_every_family_has_a_tiny_model():
    assert set(TINY_FAMILIES) == set(FAMILIES)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_knob_runs_on_the_family(family, tmp_path, timings):
    started = time.perf_counter()
    wide = {"hidden_size": 64, **({"head_dim": 16} if "head_dim" in TINY_FAMILIES[family][1] else {})}
    model = write_tiny_family(tmp_path / family, family, **wide)
    gguf = write_tiny_gguf(model, tmp_path / f"{family}.gguf") if llama_gguf(family_named(family)) else None
    spec = read_hf(load_config(model))
    runs = representatives(family, spec, gguf)
    common = dict(tokens=PROMPT, noise_floor=False, progress=False)
    rows = [*tracer.sweep(model, variants=[variant_text(v) for v in runs["sweep"]], greedy=GREEDY, **common).rows]
    if runs["decode"]:
        rows += tracer.sweep(model, variants=[variant_text(v) for v in runs["decode"]], greedy=GREEDY, decode=DECODE,
                             **common).rows
    cells = [(row.knobs, row.verdict, row.error) for row in rows]
    for variant in runs["batch"]:
        try:
            result = tracer.run(model, tokens=ROWS, batch=len(ROWS), variant=variant_text(variant), greedy=0,
                                noise_floor=False, progress=False)
            cells.append((variant, result.verdict, result.error))
        except TracerError as exc:  # a run's own one-line error (a sweep makes it the row's)
            cells.append((variant, "error", str(exc)))
    timings[family] = len(cells), time.perf_counter() - started
    assert len(cells) == sum(map(len, runs.values())) and len(PROMPT) + DECODE > WINDOW
    failed = [f"{variant_text(variant)}: {error or verdict}" for variant, verdict, error in cells
              if verdict not in ("match", "diverged") and not (error and refusal(variant, error))]
    assert not failed, "\n".join(failed)
