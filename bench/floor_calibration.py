"""The cheap noise floor against the exact one, at every point: the calibration table of docs/floor.md.

The exact floor is the floor's definition: per point, rel_l2 between the reference (transformers, f32)
and an f64 run of the same model on the whole prompt. The cheap floor is an f64 run of the prompt's
first `floor_rows` tokens (a quarter to a half of them), compared with the reference's rows of those
tokens (`tracer.pipeline.noise_floor.prefix_noise`). A point's ratio is exact / cheap, each taken as the
bound it sets (`Tolerance.threshold`: below the absolute floor both are that floor, and the ratio 1).
The rule the run applies is built on the worst ratios: the cheap floor times FLOOR_SCALE is never
below the exact one (docs/floor.md).

    python bench/floor_calibration.py                          # SmolLM2 and every family's tiny model
    python bench/floor_calibration.py --models llama-1b llama-8b:2 --tokens 64 512

Models: `smollm2` (the bundled one, trained: massive activations at the first token), a family name
of tests/families.py (a tiny random model written by transformers' `save_pretrained`), or a shape of
bench/checkpoints.py (`llama-1b`, `llama-8b:2`: random bf16 weights). Appends its table to
bench/results.md.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import tracer  # noqa: E402
from tracer.comparison.result import Tolerance  # noqa: E402
from tracer.files.sources import ModelSource  # noqa: E402
from tracer.pipeline.noise_floor import estimate_noise, floor_rows, prefix_noise  # noqa: E402


def model_and_tokens(name: str, folder: Path, count: int) -> tuple[Path, list[int]]:
    if name == "smollm2":
        from tracer.files.tokenizer import tokenize

        model = tracer.default_model_path(progress=False)
        text = "".join(path.read_text() for path in sorted((HERE.parent / "docs").glob("*.md")))
        return model, tokenize(model, text)[:count]
    generator = torch.Generator().manual_seed(0)
    if ":" in name or name in ("llama-1b", "llama-8b"):
        from checkpoints import write_checkpoint

        shape, _, layers = name.partition(":")
        model = write_checkpoint(shape, int(layers) if layers else None)
        vocab = 128256
    else:
        from tests.families import write_tiny_family

        model = write_tiny_family(folder / name, name, max_position_embeddings=4096)
        vocab = 97
    return model, torch.randint(3, vocab, (count,), generator=generator).tolist()


def bound(noise: float | None, tolerance: Tolerance) -> float:
    return tolerance.threshold(noise or 0.0)


def calibrate(name: str, tokens: int, folder: Path, rows: int | None) -> dict:
    model, ids = model_and_tokens(name, folder, tokens)
    rows = rows or floor_rows(len(ids), "cheap")
    source = ModelSource(model)
    started = time.perf_counter()
    reference = tracer.record(model, ids, engine="hf", progress=False)
    reference_s = time.perf_counter() - started
    started = time.perf_counter()
    exact = estimate_noise(source, reference, {})
    exact_s = time.perf_counter() - started
    started = time.perf_counter()
    cheap = prefix_noise(source, reference, {}, rows,
                         lambda count: tracer.record(model, ids[:count], engine="hf", progress=False))
    cheap_s = time.perf_counter() - started
    tolerance = Tolerance()
    ratios = {point: bound(exact[point], tolerance) / bound(cheap.get(point), tolerance) for point in exact}
    worst = max(ratios, key=ratios.get)
    lowest = min(ratios, key=ratios.get)
    raw = [exact[p] / cheap[p] for p in exact if cheap.get(p) and exact[p]]
    return {"model": name, "tokens": len(ids), "rows": rows, "points": len(ratios), "worst": ratios[worst],
            "worst_point": worst, "lowest": ratios[lowest], "lowest_point": lowest,
            "raw_max": max(raw, default=math.nan), "raw_min": min(raw, default=math.nan),
            "reference_s": reference_s, "exact_s": exact_s, "cheap_s": cheap_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    families = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "olmo2", "mixtral", "qwen2_moe",
                "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3"]
    parser.add_argument("--models", nargs="+", default=["smollm2", *families])
    parser.add_argument("--tokens", nargs="+", type=int, default=[64, 512])
    parser.add_argument("--rows", type=int, help="the cheap floor's tokens (default: the run's, `floor_rows`)")
    args = parser.parse_args()
    torch.manual_seed(0)
    lines = ["", f"### Cheap floor against the exact floor, {time.strftime('%Y-%m-%d %H:%M')}", "",
             "| model | tokens | rows | points | worst exact/cheap | at | lowest | at | raw max | raw min | "
             "reference s | exact s | cheap s |", "|" + "---|" * 13]
    print("\n".join(lines[1:]), flush=True)
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models:
            for tokens in args.tokens:
                r = calibrate(name, tokens, Path(folder), args.rows)
                line = (f"| {r['model']} | {r['tokens']} | {r['rows']} | {r['points']} | {r['worst']:.3f} | "
                        f"{r['worst_point']} | {r['lowest']:.3f} | {r['lowest_point']} | {r['raw_max']:.3f} | "
                        f"{r['raw_min']:.3f} | "
                        f"{r['reference_s']:.1f} | {r['exact_s']:.1f} | {r['cheap_s']:.1f} |")
                print(line, flush=True)
                lines.append(line)
    with open(HERE / "results.md", "a") as out:
        out.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
