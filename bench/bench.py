"""What tracing costs, as ratios to a plain transformers eager forward measured in the same run.

    python bench/bench.py            # full: 512 tokens, 5 repeats, whole-run timings
    python bench/bench.py --quick    # CI-sized: 256 tokens, 3 repeats (well under two minutes)

Prints a table and writes it to bench/results.md (the machine is named in it). Each timing is
the median of the repeats after one warm-up; ratios divide by the plain forward of the same
loaded model, so the machine's speed cancels out. Forward hooks cloning every module output
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
import statistics
import subprocess
import sys
import time
from importlib.metadata import version
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

    llama = Llama.from_dir(model_dir)
    token_tensor = torch.tensor(tokens)
    timings = {
        "plain eager forward (transformers)": median_time(plain, repeats),
        "tracer.record(model, tokens, engine='hf')": median_time(lambda: tracer.record(model, tokens, engine="hf", progress=False), repeats),
        "reimpl forward, every point recorded": median_time(lambda: llama.forward(token_tensor, TraceRecorder()), repeats),
        "reimpl forward, nothing recorded": median_time(lambda: llama.forward(token_tensor), repeats),
    }
    others, missing = _others(model, ids, repeats)
    return {**timings, **others}, missing


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
            name, seconds = package, f"failed: {type(error).__name__}: {_first_line(error)}"
        found[name] = seconds
    return found, missing


def _first_line(error: Exception) -> str:
    lines = str(error).splitlines() or [""]
    return lines[0][:200].replace("|", "/")  # a "|" would split the markdown row


def _forward_hooks(model, ids, repeats: int) -> tuple[str, float]:
    kept = []
    handles = [module.register_forward_hook(lambda module, args, output: kept.append(_clone(output)))
               for module in model.modules()]

    def hooked():
        kept.clear()
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False)

    try:
        seconds = median_time(hooked, repeats)
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

    return f"nnsight {version('nnsight')} trace saving all {len(envoys)} module outputs (not cloned)", median_time(nnsight_save, repeats)


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

    seconds = median_time(run_with_cache, repeats)
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
    return {name: median_time(lambda cmd=cmd: subprocess.run(cmd, check=True, capture_output=True, env=env), repeats)
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
    args = parser.parse_args()
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
