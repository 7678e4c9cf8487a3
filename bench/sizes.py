"""The benchmark's size axis: `tracer run` on random-weight bf16 checkpoints of real shapes, each
row as ratios against the floor measured in the same run: a plain transformers bf16 forward of the
same checkpoint loaded with `low_cpu_mem_usage`, as a process (load + one forward), the way a user
would check that the model runs at all.

    python bench/sizes.py                          # 1B shape and the 8B width at 2 and 8 layers, 64 tokens
    python bench/sizes.py --sizes llama-1b:16 --tokens 64 512
    python bench/sizes.py --sizes llama-8b:32 --flags= --flags=--no-noise
    python bench/sizes.py --device cuda --sizes llama-1b:16 llama-8b:32   # on a CUDA machine
    python bench/sizes.py --tracer /tmp/before --tracer .   # before/after rows in one sitting
    python bench/sizes.py --sizes llama-8b:2 llama-8b:8 llama-8b:32 --repeat 3   # the fastest of three

Each size gives two rows: the run with an empty tracer cache (its noise floor measured), and the same
run again with that cache (the floor read back), each against the floor measured just before it.

`--tracer DIR` runs `tracer run` from another source tree (DIR holds the `tracer` package, e.g.
`git archive REV tracer | tar -x -C DIR`, with hooks/ and reports/ moved under tracer/), one row
per tree given: a change and the code before it measured in the same sitting, the load of a
shared machine alike for both. Each row also gives the run's stage timings (`--json`'s `timings`).

With `--device cuda` both the floor (transformers' bf16 model moved to the GPU) and `tracer run
--device cuda` (weights streamed block by block into device memory) run on the GPU, and each
process's peak GPU memory is read from `nvidia-smi` every 0.2 s (what the driver reports for the
process: torch's caching allocator's reservations, the CUDA context included).

Each process is watched from outside: wall time, and the peak of its resident memory split into
anonymous (what it allocated) and file-backed (pages of the memory-mapped checkpoint, which the
kernel may drop under pressure), sampled from /proc every 20 ms, with the kernel's own VmHWM. The
checkpoints are written by bench/checkpoints.py under bench/.bench-models/ (never committed).
Appends its table to bench/results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from checkpoints import write_checkpoint  # noqa: E402

FLOOR = """
import sys, torch
from transformers import AutoModelForCausalLM
device = sys.argv[3]
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16, low_cpu_mem_usage=True).to(device)
with torch.inference_mode():
    model(input_ids=torch.tensor([[int(t) for t in sys.argv[2].split(",")]], device=device), use_cache=False)
if device != "cpu":
    torch.cuda.synchronize()
"""


def gpu_memory(pid: int) -> float:
    """Bytes of GPU memory the driver reports for process `pid` (0 where none, or no nvidia-smi)."""
    try:
        listed = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0.0
    used = [float(mib) for owner, mib in (line.split(",") for line in listed.splitlines() if "," in line)
            if int(owner) == pid]
    return sum(used) * 2**20


def watched(cmd: list[str], env: dict | None = None, gpu: bool = False, cwd: str | None = None) -> dict[str, float]:
    """Wall seconds and peak resident memory (GB: anonymous, file-backed, the kernel's VmHWM) of a
    process; with `gpu`, its peak GPU memory too (`gpu`, from nvidia-smi every 0.2 s)."""
    started = time.perf_counter()
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, **(env or {})}, cwd=cwd)
    peak = {"anon": 0, "file": 0, "hwm": 0, "gpu": 0}
    asked = 0.0
    while process.poll() is None:
        if gpu and time.perf_counter() - asked > 0.2:
            asked = time.perf_counter()
            peak["gpu"] = max(peak["gpu"], gpu_memory(process.pid))
        try:
            status = Path(f"/proc/{process.pid}/status").read_text()
        except OSError:
            break
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        for key, field in (("anon", "RssAnon"), ("file", "RssFile"), ("hwm", "VmHWM")):
            if field in fields:
                peak[key] = max(peak[key], int(fields[field].split()[0]) * 1024)
        time.sleep(0.02)
    _, errors = process.communicate()
    if process.returncode:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({process.returncode}): {errors[-2000:]}")
    return {"wall": time.perf_counter() - started, **{key: value / 1e9 for key, value in peak.items()}}


def row(model: Path, tokens: int, flags: str, device: str = "cpu", tracer: str | None = None,
        repeat: int = 1) -> dict:
    """The floor and `tracer run` with an empty tracer cache (`first`: the noise floor measured), then the
    floor again and the same run again (`second`: the noise floor read from the cache), `repeat` times:
    the fastest of each, each run against the floor measured just before it (a checkpoint the page cache
    lost to the one before is read from disk by whichever runs first)."""
    ids = ",".join(str(1000 + (7 * i) % 120000) for i in range(tokens))
    gpu = device != "cpu"
    placement = ["--device", device] if gpu else []
    best: dict = {}
    for _ in range(repeat):
        with tempfile.TemporaryDirectory() as cache:
            for which in ("first", "second"):
                floor = watched([sys.executable, "-c", FLOOR, str(model), ids, device], gpu=gpu)
                summary = Path(cache) / "summary.json"
                env = {"TRACER_CACHE": cache}
                if tracer is not None:  # that tree's package first (run from the cache folder: no checkout on sys.path)
                    env["PYTHONPATH"] = str(Path(tracer).resolve())
                run = watched([sys.executable, "-m", "tracer", "run", "--model", str(model.resolve()), "--tokens",
                               ids, "--json", str(summary), *placement, *flags.split()], env=env, gpu=gpu, cwd=cache)
                timings = json.loads(summary.read_text()).get("timings", {})
                ratio = run["wall"] / floor["wall"]
                if which not in best or ratio < best[which]["run"]["wall"] / best[which]["floor"]["wall"]:
                    best[which] = {"floor": floor, "run": run, "timings": timings}
    return best


def line(name: str, tokens: int, flags: str, measured: dict) -> str:
    floor, run = measured["floor"], measured["run"]
    return (f"| {name} | {tokens} | `tracer run {flags}`".rstrip() + " | "
            f"{run['wall']:.1f} s, anon {run['anon']:.2f} GB + file {run['file']:.2f} GB (HWM {run['hwm']:.2f}) | "
            f"{floor['wall']:.1f} s, anon {floor['anon']:.2f} + file {floor['file']:.2f} GB | "
            f"{run['wall'] / floor['wall']:.2f}× | {run['anon'] / floor['anon']:.2f}× anon, "
            f"{run['hwm'] / floor['hwm']:.2f}× HWM" + _gpu_cells(floor, run) + " | "
            + _stages(measured["timings"]) + " |")


def _stages(timings: dict) -> str:
    return ", ".join(f"{key.removesuffix('_s')} {seconds:.1f}" for key, seconds in timings.items() if seconds >= 0.05)


def _gpu_cells(floor: dict, run: dict) -> str:
    if not floor["gpu"]:
        return ""
    return f"; GPU {run['gpu']:.2f} GB against {floor['gpu']:.2f} GB ({run['gpu'] / floor['gpu']:.2f}×)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["llama-1b:16", "llama-8b:2", "llama-8b:8"],
                        help="shape:layers, shapes as bench/checkpoints.py names them")
    parser.add_argument("--tokens", type=int, nargs="+", default=[64])
    parser.add_argument("--device", default="cpu", help="cpu, or cuda / cuda:N on a CUDA machine")
    parser.add_argument("--tracer", action="append", help="a source tree to run tracer from, one row each "
                        "(default: the installed tracer)")
    parser.add_argument("--repeat", type=int, default=1, help="measure each row this many times, keep the fastest")
    parser.add_argument("--flags", action="append", help="tracer run flags, one row each time it is given "
                        "(--flags=--no-noise; default: one row of default flags)")
    args = parser.parse_args()
    lines = ["| model | tokens | command | run: wall, peak RSS | floor: bf16 load + forward | time | memory | "
             "stages (s) |", "|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for size in args.sizes:
        shape, layers = size.split(":")
        model = write_checkpoint(shape, int(layers))
        for tokens in args.tokens:
            for flags in args.flags or [""]:
                for tree in args.tracer or [None]:
                    measured = row(model, tokens, flags, args.device, tree, args.repeat)
                    name = f"{shape}, {layers} layers, {args.device}" + (f", tracer from {tree}" if tree else "")
                    for which, said in (("first", ""), ("second", ", second run (floor from the cache)")):
                        lines.append(line(name + said, tokens, flags, measured[which]))
                        print(lines[-1], flush=True)
    load = os.getloadavg()
    lines.append(f"\n{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, load average {load[0]:.1f} "
                 f"(the machine is shared)")
    with (HERE / "results.md").open("a") as out:
        out.write("\n## Sizes\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
