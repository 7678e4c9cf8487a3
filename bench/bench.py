"""What tracing costs, as ratios to a plain transformers eager forward measured in the same run.

    python bench/bench.py            # full: 512 tokens, 5 repeats, whole-run timings
    python bench/bench.py --quick    # CI-sized: 256 tokens, 3 repeats (well under two minutes)
    python bench/bench.py --threads 1   # steadier figures on a small, busy machine

Prints a table and writes it to bench/results.md (the machine is named in it). Each timing is
the best of the repeats after one warm-up (as `timeit` reports: what else runs on the machine
only ever adds time); ratios divide by the plain forward of the same loaded model, so the
machine's speed cancels out. A sweep's cost per variant is given in the same unit. Forward hooks cloning every module output
are measured as a baseline; where nnsight or TransformerLens are installed they are measured
side by side (each on its own copy of the model, as both rewire the modules they wrap), and the
table names those that are not.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import platform
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import torch

from tracer.errors import one_line

HERE = Path(__file__).resolve().parent
TEXT = HERE.parent / "tests" / "data" / "porting.txt"


def best_time(fn, repeats: int) -> float:
    fn()  # warm-up: first-call allocations and lazy imports are not what we measure
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def bench_tokens(model_dir: Path, count: int) -> list[int]:
    from tracer.model import tokenize

    ids = tokenize(model_dir, TEXT.read_text())
    return (ids * (count // len(ids) + 1))[:count]


def in_process(model_dir: Path, tokens: list[int], repeats: int) -> tuple[dict[str, float | str], list[str]]:
    """Seconds for a plain eager forward and for each way of recording it; the tools not installed."""
    import tracer
    from transformers import LlamaForCausalLM

    from tracer.llama import Llama
    from tracer.trace import TraceRecorder

    model = LlamaForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    ids = torch.tensor([tokens])

    def plain():
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False)

    llama, streamed = Llama.from_dir(model_dir), Llama.from_dir(model_dir, stream=True)
    token_tensor = torch.tensor(tokens)
    timings = {
        "plain eager forward (transformers)": best_time(plain, repeats),
        "tracer.record(model, tokens, engine='hf')": best_time(lambda: tracer.record(model, tokens, engine="hf", progress=False), repeats),
        "reimpl forward, every point recorded": best_time(lambda: llama.forward(token_tensor, TraceRecorder()), repeats),
        "reimpl forward, nothing recorded": best_time(lambda: llama.forward(token_tensor), repeats),
        "reimpl forward, weights streamed block by block (--stream), every point recorded":
            best_time(lambda: streamed.forward(token_tensor, TraceRecorder()), repeats),
        "sweep: added cost per variant (reimpl forward, diff)": _sweep_per_variant(model_dir, tokens),
    }
    others, missing = _others(model, ids, repeats)
    return {**timings, **others}, missing


SWEEP_VARIANTS = ["theta=10000", "eps=1e-3", "kv_repeat=tile", "rope=interleaved", "mask=none"]


def _sweep_per_variant(model_dir: Path, tokens: list[int]) -> float:
    """The best of the variants' own times in a sweep (the reference, recorded once, excluded)."""
    from tracer.api import sweep

    result = sweep(model_dir, tokens=tokens, variants=SWEEP_VARIANTS, noise_floor=False, progress=False)
    return min(row.seconds for row in result.rows)


def _others(model, ids, repeats: int) -> tuple[dict[str, float | str], list[str]]:
    """Other ways of recording every module output of the same model: seconds, or the error
    of a tool that is installed but failed; and the tools that are not installed."""
    found: dict[str, float | str] = dict([_forward_hooks(model, ids, repeats)])
    missing = []
    for package, measure in {"nnsight": _nnsight, "transformer_lens": _transformer_lens}.items():
        if importlib.util.find_spec(package) is None:
            missing.append(package)
            continue
        try:
            name, seconds = measure(model, ids, repeats)
        except Exception as error:  # one tool's failure is a row of the table, not the end of the bench
            # A "|" would split the markdown row.
            name, seconds = package, f"failed: {type(error).__name__}: {one_line(error)}".replace("|", "/")
        found[name] = seconds
    return found, missing


def _forward_hooks(model, ids, repeats: int) -> tuple[str, float]:
    kept = []
    handles = [module.register_forward_hook(lambda module, args, output: kept.append(_clone(output)))
               for module in model.modules()]

    def hooked():
        kept.clear()
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False)

    try:
        seconds = best_time(hooked, repeats)
    finally:
        for handle in handles:
            handle.remove()
    return f"forward hooks cloning every module output ({len(kept)} modules)", seconds


def _clone(output):
    if isinstance(output, torch.Tensor):
        return output.clone()
    if isinstance(output, dict):  # transformers' ModelOutput is a dict
        output = list(output.values())
    return [_clone(value) for value in output] if isinstance(output, (tuple, list)) else output


def _nnsight(model, ids, repeats: int) -> tuple[str, float]:
    import nnsight

    order = _output_order(model, ids)
    wrapped = nnsight.NNsight(copy.deepcopy(model))  # nnsight instruments the modules it wraps
    # nnsight hands each output over as the model produces it: asking for one it already
    # produced is an OutOfOrderError, so the outputs are asked for in the order they come.
    envoys = [wrapped.get(name) if name else wrapped for name in order]

    def nnsight_save():
        with torch.inference_mode(), wrapped.trace(ids, use_cache=False):
            nnsight.save([envoy.output for envoy in envoys])  # the list is what leaves the trace

    return f"nnsight {version('nnsight')} trace saving all {len(envoys)} module outputs (not cloned)", best_time(nnsight_save, repeats)


def _output_order(model, ids) -> list[str]:
    """Module names in the order their forward returns (children before their parent)."""
    order = []
    handles = [module.register_forward_hook(lambda *_, name=name: order.append(name))
               for name, module in model.named_modules()]
    try:
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return order


def _transformer_lens(model, ids, repeats: int) -> tuple[str, float]:
    from transformer_lens.model_bridge import TransformerBridge

    # The bridge swaps the model's submodules for its own in place, hence a copy; it keeps
    # the HF weights unprocessed, so it computes what the plain forward computes.
    bridge = TransformerBridge.boot_transformers(model.name_or_path, hf_model=copy.deepcopy(model), device="cpu")
    cached = []

    def run_with_cache():
        with torch.inference_mode():
            cached[:] = [bridge.run_with_cache(ids)[1]]

    seconds = best_time(run_with_cache, repeats)
    return f"TransformerLens {version('transformer_lens')} TransformerBridge.run_with_cache, all {len(cached[0])} hook points (not cloned)", seconds


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
    return {name: best_time(lambda cmd=cmd: subprocess.run(cmd, check=True, capture_output=True, env=env), repeats)
            for name, cmd in commands.items()}


def table(timings: dict[str, float | str], baseline: str) -> list[str]:
    rows = ["| measurement | seconds | ratio |", "|---|--:|--:|"]
    for name, seconds in timings.items():
        if isinstance(seconds, str):  # a tool that failed: its error instead of figures
            rows.append(f"| {name} | {seconds} | |")
        else:
            rows.append(f"| {name} | {seconds:.3f} | {seconds / timings[baseline]:.2f}× |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI-sized: fewer tokens and repeats")
    parser.add_argument("--tokens", type=int, help="prompt length (default 512, quick 256)")
    parser.add_argument("--threads", type=int, help="torch threads, here and in the timed processes (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the whole-run processes
    import tracer

    model_dir = tracer.default_model_path()
    count = args.tokens or (256 if args.quick else 512)
    repeats = 3 if args.quick else 5
    forward, missing = in_process(model_dir, bench_tokens(model_dir, count), repeats)
    runs = whole_run(model_dir, 1 if args.quick else 3)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {platform.python_version()}"
    lines = [f"# tracer benchmark ({count} tokens, bundled SmolLM2, f32, {torch.get_num_threads()} threads; {machine})", ""]
    lines += table(forward, "plain eager forward (transformers)") + [""]
    if missing:
        lines += [f"Not installed, so not measured: {', '.join(missing)}.", ""]
    lines += table(runs, "bare script: import transformers, load, one forward")
    text = "\n".join(lines)
    print(text)
    (HERE / "results.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
