"""What tracing costs, as ratios to a plain transformers eager forward measured in the same run.

    python bench/bench.py            # full: 512 tokens, 5 repeats, whole-run timings
    python bench/bench.py --quick    # CI-sized: 256 tokens, 3 repeats (well under two minutes)

Prints a table and writes it to bench/results.md (the machine is named in it). Each timing is
the median of the repeats after one warm-up; ratios divide by the plain forward of the same
loaded model, so the machine's speed cancels out. Where nnsight or TransformerLens are
installed they are measured side by side.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
TEXT = HERE.parent / "tests" / "data" / "porting.txt"


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up: first-call allocations and lazy imports are not what we measure
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def bench_tokens(model_dir: Path, count: int) -> list[int]:
    from tracer.model import tokenize

    ids = tokenize(model_dir, TEXT.read_text())
    return (ids * (count // len(ids) + 1))[:count]


def in_process(model_dir: Path, tokens: list[int], repeats: int) -> dict[str, float]:
    """Seconds for a plain eager forward and for each way of recording it."""
    import tracer
    from transformers import LlamaForCausalLM

    from tracer.llama import Llama
    from tracer.trace import TraceRecorder

    model = LlamaForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    ids = torch.tensor([tokens])

    def plain():
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False)

    llama = Llama.from_dir(model_dir)
    token_tensor = torch.tensor(tokens)
    timings = {
        "plain eager forward (transformers)": median_time(plain, repeats),
        "tracer.record(model, tokens, engine='hf')": median_time(lambda: tracer.record(model, tokens, engine="hf", progress=False), repeats),
        "reimpl forward, every point recorded": median_time(lambda: llama.forward(token_tensor, TraceRecorder()), repeats),
        "reimpl forward, nothing recorded": median_time(lambda: llama.forward(token_tensor), repeats),
    }
    timings.update(_others(model, ids, repeats))
    return timings


def _others(model, ids, repeats: int) -> dict[str, float]:
    """Other tools, when installed, recording module outputs of the same model."""
    found = {}
    try:
        from nnsight import NNsight
    except ImportError:
        return found
    wrapped = NNsight(model)

    def nnsight_save():
        with torch.inference_mode(), wrapped.trace(ids):
            [module.output.save() for module in wrapped.model.layers]

    found["nnsight, block outputs saved"] = median_time(nnsight_save, repeats)
    return found


def whole_run(model_dir: Path, repeats: int) -> dict[str, float]:
    """Seconds for `tracer run --variant theta=10000` as a process vs a bare transformers script."""
    bare = (
        "import torch, transformers; from transformers import LlamaForCausalLM, AutoTokenizer\n"
        f"m = LlamaForCausalLM.from_pretrained({str(model_dir)!r}, attn_implementation='eager').eval()\n"
        f"ids = AutoTokenizer.from_pretrained({str(model_dir)!r})('The capital of France is', return_tensors='pt').input_ids\n"
        "with torch.inference_mode(): m(ids)\n"
    )
    out = HERE / ".bench-report"
    commands = {
        "bare script: import transformers, load, one forward": [sys.executable, "-c", bare],
        "tracer run --variant theta=10000 (report written)": [
            sys.executable, "-m", "tracer", "run", "--model", str(model_dir), "--variant", "theta=10000",
            "--out", str(out), "--json", str(HERE / ".bench-summary.json")],
    }
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return {name: median_time(lambda cmd=cmd: subprocess.run(cmd, check=True, capture_output=True, env=env), repeats)
            for name, cmd in commands.items()}


def table(timings: dict[str, float], baseline: str) -> list[str]:
    rows = ["| measurement | seconds | ratio |", "|---|--:|--:|"]
    for name, seconds in timings.items():
        rows.append(f"| {name} | {seconds:.3f} | {seconds / timings[baseline]:.2f}× |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI-sized: fewer tokens and repeats")
    parser.add_argument("--tokens", type=int, help="prompt length (default 512, quick 256)")
    args = parser.parse_args()
    import tracer

    model_dir = tracer.default_model_path()
    count = args.tokens or (256 if args.quick else 512)
    repeats = 3 if args.quick else 5
    forward = in_process(model_dir, bench_tokens(model_dir, count), repeats)
    runs = whole_run(model_dir, 1 if args.quick else 3)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {platform.python_version()}"
    lines = [f"# tracer benchmark ({count} tokens, bundled SmolLM2, f32, {torch.get_num_threads()} threads; {machine})", ""]
    lines += table(forward, "plain eager forward (transformers)") + [""]
    lines += table(runs, "bare script: import transformers, load, one forward")
    text = "\n".join(lines)
    print(text)
    (HERE / "results.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
