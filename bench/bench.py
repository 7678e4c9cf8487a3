"""What tracing costs, as ratios to a plain transformers eager forward measured in the same run.

    python bench/bench.py            # full: 512 tokens, 5 repeats, whole-run timings
    python bench/bench.py --quick    # fewer tokens and repeats: 256 tokens, 3 repeats, the bit-exact regimes at
                                     # 64 and 256 tokens instead of 64, 512 and 2048 (every other row still runs)
    python bench/bench.py --threads 1   # steadier figures on a small, busy machine
    python bench/bench.py --whole-run   # only `tracer run` as a process against a bare transformers script
    python bench/bench.py --decode 64   # only `--decode 64` and the greedy check, against both engines' own
                                        # cached decodes (transformers' generate, the reimplementation's cache)
    python bench/bench.py --moe         # only recording a tiny Mixtral against recording a tiny Llama of
                                        # the same sizes, each as a ratio to its own plain forward

Prints a table and writes it to bench/results.md (the machine is named in it). Each timing is
the best of the repeats after one warm-up (as `timeit` reports: what else runs on the machine
only ever adds time). Each in-process measure is timed in rounds alternating with a plain eager
forward of the same loaded model, and its ratio divides by that forward's time from the same
rounds, so that the machine's speed, and its drift, cancel out. The whole run is timed as a
process against a bare transformers script, medians of alternating rounds, with the reference's
noise floor and greedy continuation cached by an earlier run and without. A sweep's cost per
variant is given in the same unit.

The runtime engines (mlx, onnx; where installed) are each timed against their own runtime's
plain forward instead, in the same alternating rounds: ORT running the plain export (the logits
its only output) against ORT running the export whose outputs are every point, and mlx-lm's
unrecorded forward against the recorded one. MLX's CPU build is slow, so its rows run on fewer
tokens (`--mlx-tokens`); `--engines-only` measures only these.

Forward hooks cloning every module output are measured as a baseline; where nnsight or
TransformerLens are installed (`pip install -e '.[bench]'`) they are measured side by side,
each on its own copy of the model as both rewire the modules they wrap, and the table names
those that are not. Where llama-cpp-python is installed, the llamacpp engine's recording is
measured the same way against llama.cpp's own forward (no eval callback) of the same tokens,
and where candle-nn is installed the candle engine's against candle's plain forward (the same
composed ops, nothing kept), on the f32 directory (llama.rs) and the GGUF (quantized_llama.rs);
`--candle` measures only these and candle's regime.
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Callable

import torch

from tracer.core.errors import one_line

HERE = Path(__file__).resolve().parent
TEXT = HERE.parent / "tests" / "data" / "porting.txt"


def best_times(measures: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Seconds per measure: the best of `repeats` after one warm-up each, taken in rounds (every
    measure once per round) so that a machine whose speed drifts affects all of them alike."""
    for fn in measures.values():
        fn()  # warm-up: first-call allocations and lazy imports are not what we measure
    times: dict[str, list[float]] = {name: [] for name in measures}
    for _ in range(repeats):
        for name, fn in measures.items():
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    return {name: min(values) for name, values in times.items()}


def bench_tokens(model_dir: Path, count: int) -> list[int]:
    from tracer.files.tokenizer import tokenize

    ids = tokenize(model_dir, TEXT.read_text())
    return (ids * (count // len(ids) + 1))[:count]


def in_process(model_dir: Path, tokens: list[int], repeats: int) -> tuple[dict[str, float | str], list[str]]:
    """Seconds for a plain eager forward and for each way of recording it; the tools not installed."""
    from transformers import LlamaForCausalLM

    import tracer
    from tracer.reimpl.forward import Model
    from tracer.traces.trace import TraceRecorder

    model = LlamaForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    ids = torch.tensor([tokens])

    def plain():
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False)

    llama, streamed = Model.from_dir(model_dir), Model.from_dir(model_dir, stream=True)
    token_tensor = torch.tensor(tokens)
    measures = {
        PLAIN: plain,  # the baseline row: its own best time, ratio 1 by definition
        "tracer.record(model, tokens, engine='hf')": lambda: tracer.record(model, tokens, engine="hf", progress=False),
        "reimpl forward, every point recorded": lambda: llama.forward(token_tensor, TraceRecorder()),
        "reimpl forward, nothing recorded": lambda: llama.forward(token_tensor),
        "reimpl forward, weights streamed block by block (--stream), every point recorded":
            lambda: streamed.forward(token_tensor, TraceRecorder()),
    }
    others, failed, missing = _others(model, ids)
    timings: dict[str, tuple[float, float] | str] = {}
    for name, fn in {**measures, **others}.items():
        # Each against the plain forward timed in the same rounds: an A/B, as the machine drifts.
        pair = best_times({PLAIN: plain, name: fn}, repeats)
        timings[name] = (pair[name], pair[name] / pair[PLAIN])
    sweep_seconds = _sweep_per_variant(model_dir, tokens)
    timings["sweep: added cost per variant (reimpl forward, diff)"] = (
        sweep_seconds, sweep_seconds / best_times({PLAIN: plain}, repeats)[PLAIN])
    return {**timings, **failed}, missing


PLAIN = "plain eager forward (transformers)"
LLAMACPP_PLAIN = "llama.cpp's own plain forward (no eval callback), logits of every position"


def llamacpp_rows(model_dir: Path, tokens: list[int], repeats: int,
                  threads: int | None = None) -> dict[str, tuple[float, float]] | None:
    """The llamacpp engine's recording cost, as ratios to llama.cpp's own forward of the same
    tokens on the same GGUF and settings without an eval callback, timed in alternating rounds
    (None where llama-cpp-python is not installed). In process, as the engine runs inside its
    child; the isolated row adds the child's part: the trace written and read back once."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    from tracer.engines import llamacpp
    from tracer.engines.load import resolve_and_load
    from tracer.files.sources import ModelSource

    variant = {"threads": threads} if threads else {}  # --threads: llama.cpp's too
    plain_engine = llamacpp.load(ModelSource(model_dir), variant, observe=False)
    engine, child = llamacpp.load(ModelSource(model_dir), variant), resolve_and_load("llamacpp", model_dir, variant)

    def plain():
        plain_engine.logits(tokens)

    flash = engine.record(tokens[:8]).meta.flash_attn  # what flash_attn=auto chose here
    rows = {f"{LLAMACPP_PLAIN} (flash attention {flash})": (best_times({"plain": plain}, repeats)["plain"], 1.0)}
    measures = {
        "llamacpp engine, every point llama.cpp shows recorded (in process)": lambda: engine.record(tokens),
        "llamacpp engine in its child process (isolated), every point recorded and read back":
            lambda: child.record(tokens),
    }
    for name, fn in measures.items():
        pair = best_times({"plain": plain, name: fn}, repeats)
        rows[name] = (pair[name], pair[name] / pair["plain"])
    return rows


CANDLE_PLAIN = "candle's plain forward (nothing kept), logits of every position"


def candle_rows(model_dir: Path, tokens: list[int], repeats: int) -> dict[str, tuple[float, float]] | None:
    """The candle engine's recording cost on llama.rs (f32 directory) and quantized_llama.rs (the
    bundled GGUF), each as a ratio to candle's own unrecorded forward of the same engine, timed in
    alternating rounds (None where candle-nn is not installed). In process; the isolated row adds
    the child's part on the GGUF."""
    if importlib.util.find_spec("candle") is None:
        return None
    from tracer.engines import candle
    from tracer.engines.load import resolve_and_load
    from tracer.files.sources import ModelSource, bundled_gguf

    rows = {}
    gguf = str(bundled_gguf())
    for label, argument in (("llama.rs, f32 directory", None), ("quantized_llama.rs, Q4_1 GGUF", gguf)):
        engine = candle.load(ModelSource(model_dir), {}, argument=argument)
        measures = {"plain": lambda engine=engine: engine.plain_forward(tokens),
                    "recorded": lambda engine=engine: engine.record(tokens)}
        if argument:
            child = resolve_and_load(f"candle:{gguf}", model_dir, {})
            measures["child"] = lambda child=child: child.record(tokens)
        times = best_times(measures, repeats)
        rows[f"{CANDLE_PLAIN}: {label}"] = (times["plain"], 1.0)
        rows[f"candle engine, every point recorded ({label}, in process)"] = (times["recorded"],
                                                                            times["recorded"] / times["plain"])
        if argument:
            rows[f"candle engine in its child process (isolated, {label}), recorded and read back"] = (
                times["child"], times["child"] / times["plain"])
    return rows


SWEEP_VARIANTS = ["theta=10000", "eps=1e-3", "kv_repeat=tile", "rope=interleaved", "mask=none"]


def _sweep_per_variant(model_dir: Path, tokens: list[int]) -> float:
    """The best of the variants' own times in a sweep (the reference, recorded once, excluded)."""
    from tracer import sweep

    result = sweep(model_dir, tokens=tokens, variants=SWEEP_VARIANTS, noise_floor=False, progress=False)
    return min(row.seconds for row in result.rows)


def _others(model, ids) -> tuple[dict[str, Callable[[], object]], dict[str, str], list[str]]:
    """Other ways of recording every module output, each on its own copy of the model (nnsight
    and TransformerLens rewire the modules they wrap): the measures, the errors of tools that are
    installed but failed to set up, and the tools that are not installed."""
    measures = dict([_forward_hooks(copy.deepcopy(model), ids)])
    failed, missing = {}, []
    for package, setup in {"nnsight": _nnsight, "transformer_lens": _transformer_lens}.items():
        if importlib.util.find_spec(package) is None:
            missing.append(package)
            continue
        try:
            name, fn = setup(copy.deepcopy(model), ids)
            fn()  # a tool that fails at its first run is a row with its error, not the end of the bench
            measures[name] = fn
        except Exception as error:  # noqa: BLE001
            # A "|" would split the markdown row.
            failed[package] = f"failed: {type(error).__name__}: {one_line(error)}".replace("|", "/")
    return measures, failed, missing


def _forward_hooks(model, ids) -> tuple[str, Callable[[], object]]:
    kept = []
    for module in model.modules():
        module.register_forward_hook(lambda module, args, output: kept.append(_clone(output)))

    def hooked():
        kept.clear()
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False)

    hooked()
    return f"forward hooks cloning every module output ({len(kept)} modules)", hooked


def _clone(output):
    if isinstance(output, torch.Tensor):
        return output.clone()
    if isinstance(output, dict):  # transformers' ModelOutput is a dict
        output = list(output.values())
    return [_clone(value) for value in output] if isinstance(output, (tuple, list)) else output


def _nnsight(model, ids) -> tuple[str, Callable[[], object]]:
    import nnsight

    order = _output_order(model, ids)
    wrapped = nnsight.NNsight(model)  # nnsight instruments the modules it wraps
    # nnsight hands each output over as the model produces it: asking for one it already
    # produced is an OutOfOrderError, so the outputs are asked for in the order they come.
    envoys = [wrapped.get(name) if name else wrapped for name in order]

    def nnsight_save():
        with torch.inference_mode(), wrapped.trace(ids, use_cache=False):
            nnsight.save([envoy.output for envoy in envoys])  # the list is what leaves the trace

    return f"nnsight {version('nnsight')} trace saving all {len(envoys)} module outputs (not cloned)", nnsight_save


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


def _transformer_lens(model, ids) -> tuple[str, Callable[[], object]]:
    from transformer_lens.model_bridge import TransformerBridge

    # The bridge swaps the model's submodules for its own in place (this is a copy); it keeps the
    # HF weights unprocessed, so it computes what the plain forward computes.
    bridge = TransformerBridge.boot_transformers(model.name_or_path, hf_model=model, device="cpu")
    with torch.inference_mode():
        hook_points = len(bridge.run_with_cache(ids)[1])

    def run_with_cache():
        with torch.inference_mode():
            bridge.run_with_cache(ids)

    return (f"TransformerLens {version('transformer_lens')} TransformerBridge.run_with_cache, all {hook_points} "
            "hook points (not cloned)"), run_with_cache


# MLX's CPU build (a shared 2-core x86 VM) takes about 0.4 s per token of SmolLM2: 512 tokens would be
# minutes per forward, so its rows run on fewer tokens (--mlx-tokens).
MLX_TOKENS, MLX_TOKENS_QUICK = 32, 16


def runtime_engines(model_dir: Path, tokens: dict[str, list[int]], repeats: int) -> tuple[list[str], list[str]]:
    """Each installed runtime engine's recording cost against that runtime's own plain forward
    (ORT: the plain export, logits its only output; MLX: the unrecorded forward), timed in
    alternating rounds: table rows, and the runtimes not installed."""
    from tracer.engines.load import resolve_and_load
    from tracer.engines.registry import ENGINES

    rows = ["| engine (runtime) | tokens | plain forward, s | every point recorded, s | ratio |",
            "|---|--:|--:|--:|--:|"]
    missing = []
    for name, ids in tokens.items():
        entry = ENGINES[name]
        if entry.missing_runtime():
            missing.append(f"{name} (pip install -e '.[{entry.extra}]')")
            continue
        engine = resolve_and_load(name, model_dir, {})
        pair = best_times({"plain": lambda: engine.logits(ids), "recorded": lambda: engine.record(ids)}, repeats)
        runtime = engine.record(ids[:2]).meta.runtime
        rows.append(f"| {name} ({runtime['name']} {runtime['version']}) | {len(ids)} | {pair['plain']:.3f} | "
                    f"{pair['recorded']:.3f} | {pair['recorded'] / pair['plain']:.2f}× |")
    return rows, missing


# The llama.cpp regime (tracer.ggml) at each accumulation: the fast one, the noise floor's, the bit-exact one;
# candle's (tracer.ggml.candle), bit-exact. An empty `accumulate`: the runtime's own order, on fewer tokens.
LLAMACPP_Q = {"preset": "llamacpp", "weights": "gguf"}
REGIMES = {
    "preset=llamacpp,weights=gguf,accumulate=f32 (ggml's formats, BLAS sums)": {**LLAMACPP_Q, "accumulate": "f32"},
    "preset=llamacpp,weights=gguf,accumulate=f64 (the regime noise floor's run)": {**LLAMACPP_Q, "accumulate": "f64"},
}
EXACT_REGIME = "preset=llamacpp,weights=gguf (ggml's own order, bit-exact)"
# The k-quant rows: SmolLM2 requantized to Q4_K_M by llama.cpp's own quantizer (Q4_K/Q6_K ffn_down,
# Q5_0/Q8_0 elsewhere: its width 576 is not a multiple of 256).
KQUANT_FILE = "Q4_K_M"
KQUANT_REGIME = f"preset=llamacpp,weights=gguf on SmolLM2 {KQUANT_FILE} (ggml's own order, bit-exact)"
CANDLE_REGIME = "preset=candle-q,weights=gguf (candle's own order, bit-exact)"
CANDLE_KQUANT_REGIME = (f"preset=candle-q,weights=gguf on SmolLM2 {KQUANT_FILE} "
                        "(candle's Q5_0 loop and k-quant kernels)")
# --regime auto judges free-running up to 2048 tokens (tracer.pipeline.regime_view.EXACT_TOKENS)
EXACT_REGIME_TOKENS = (64, 512, 2048)
# SmolLM2 files llama.cpp's quantizer makes from the bundled GGUF, and the kernels they bring: the
# bit-exact regime on each at 512 tokens.
FILE_REGIMES = {"Q4_0": "repacked q4_0_8x8 gemm/gemv", "F16": "tinyBLAS on f16 weights"}
FILE_REGIME_TOKENS = 512


def median_ratio(measure: Callable[[], object], baseline: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(median seconds of `measure`, median of its per-round ratio to `baseline`), the two run
    alternately in `repeats` rounds after one warm-up each: on a shared machine whose speed drifts,
    each ratio compares neighbours in time."""
    measure(), baseline()
    seconds, ratios_ = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        baseline()
        base = time.perf_counter() - started
        started = time.perf_counter()
        measure()
        seconds.append(time.perf_counter() - started)
        ratios_.append(seconds[-1] / base)
    return statistics.median(seconds), statistics.median(ratios_)


def regimes(model_dir: Path, tokens: list[int], repeats: int, exact_counts: tuple[int, ...] = EXACT_REGIME_TOKENS,
            candle_only: bool = False) -> dict[str, tuple[float, float]]:
    """Seconds for a forward of the reimplementation in the llama.cpp regime (nothing recorded), and
    its ratio to the plain reimplementation forward on the same tokens in alternating rounds
    (medians); the bit-exact regimes (llama.cpp's, candle's) at each of `exact_counts` tokens, candle's
    alone with `candle_only`; both also on SmolLM2 made Q4_K_M (candle's up to the prompt length its
    regime is exact for); llama.cpp's on the files its quantizer makes (`FILE_REGIMES`) at 512 tokens
    (the files where llama-cpp-python is installed)."""
    from tracer.pipeline.regime_view import EXACT_TOKENS_CANDLE
    from tracer.reimpl.forward import Model

    plain = Model.from_dir(model_dir)
    rows = {}
    for name, knobs in REGIMES.items():
        if candle_only:
            break
        regime = Model.from_dir(model_dir, knobs)
        ids = torch.tensor(tokens)
        rows[name] = median_ratio(functools.partial(regime.forward, ids), functools.partial(plain.forward, ids),
                                  repeats)
    candle_q = {"preset": "candle-q", "weights": "gguf"}
    longest = max(exact_counts)
    exact_regimes = {CANDLE_REGIME: (model_dir, candle_q, longest)}  # label: (model, knobs, most tokens)
    if not candle_only:
        exact_regimes = {EXACT_REGIME: (model_dir, LLAMACPP_Q, longest), **exact_regimes}
    if importlib.util.find_spec("llama_cpp"):
        kquant_dir = quantized_model(model_dir, KQUANT_FILE)
        if not candle_only:
            exact_regimes[KQUANT_REGIME] = (kquant_dir, LLAMACPP_Q, longest)
        exact_regimes[CANDLE_KQUANT_REGIME] = (kquant_dir, candle_q, EXACT_TOKENS_CANDLE)
    for label, (folder, knobs, most) in exact_regimes.items():
        exact = Model.from_dir(folder, knobs)
        counts = [c for c in exact_counts if c <= most]
        for count in counts:
            ids = torch.tensor(bench_tokens(model_dir, count))
            rounds = repeats if count <= 512 else max(1, repeats // 2)
            rows[f"{label}, {count} tokens"] = median_ratio(functools.partial(exact.forward, ids),
                                                            functools.partial(plain.forward, ids), rounds)
    if not candle_only and importlib.util.find_spec("llama_cpp"):
        ids = torch.tensor(bench_tokens(model_dir, FILE_REGIME_TOKENS))
        for ftype, kernels in FILE_REGIMES.items():
            exact = Model.from_dir(quantized_model(model_dir, ftype), LLAMACPP_Q)
            rows[f"{EXACT_REGIME} on a {ftype} file ({kernels}), {FILE_REGIME_TOKENS} tokens"] = median_ratio(
                functools.partial(exact.forward, ids), functools.partial(plain.forward, ids), repeats)
    return rows


def quantized_model(model_dir: Path, ftype: str) -> Path:
    """The bundled SmolLM2 as llama.cpp's quantizer writes it in `ftype`, beside a link to the
    converted directory whose config names that file (made once, in bench/.bench-gguf)."""
    sys.path.insert(0, str(HERE.parent))  # the test helpers: llama.cpp's quantizer in a child process
    from tests.ggml_gguf import sourced_copy
    from tests.quantized_gguf import quantize_gguf
    from tracer.files.sources import bundled_gguf

    folder = HERE / ".bench-gguf"
    folder.mkdir(exist_ok=True)
    gguf, linked = folder / f"smollm2-{ftype}.gguf", folder / f"smollm2-{ftype}"
    if not gguf.is_file():
        quantize_gguf(bundled_gguf(), gguf, ftype)
    if not linked.is_dir():
        sourced_copy(model_dir, gguf, linked, link=True)
    return linked


def whole_run(model_dir: Path, repeats: int) -> dict[str, tuple[float, float]]:
    """`tracer run --variant theta=10000` as a process against a bare transformers script (import,
    load, one forward): (median seconds, median ratio) of alternating rounds, with the reference's
    noise floor and greedy continuation in the cache (every run after the first of a model and
    prompt) and without them (the first run: an empty tracer cache each round, the model given by its
    folder)."""
    bare = (
        "import torch, transformers; from transformers import LlamaForCausalLM, AutoTokenizer\n"
        f"m = LlamaForCausalLM.from_pretrained({str(model_dir)!r}, attn_implementation='eager').eval()\n"
        f"ids = AutoTokenizer.from_pretrained({str(model_dir)!r})"
        "('The capital of France is', return_tensors='pt').input_ids\n"
        "with torch.inference_mode(): m(ids)\n"
    )
    out = HERE / ".bench-report"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "tracer", "run", "--model", str(model_dir), "--variant", "theta=10000",
               "--out", str(out), "--json", str(HERE / ".bench-summary.json")]

    def process(cmd, **changed):
        return subprocess.run(cmd, check=True, capture_output=True, env={**env, **changed})

    def first_run():
        with tempfile.TemporaryDirectory() as cache:
            process(command, TRACER_CACHE=cache)

    bare_seconds = []

    def baseline():  # timed in the same rounds as the runs it is the yardstick of
        started = time.perf_counter()
        process([sys.executable, "-c", bare])
        bare_seconds.append(time.perf_counter() - started)

    cached = median_ratio(functools.partial(process, command), baseline, repeats)
    first = median_ratio(first_run, baseline, repeats)
    return {"bare script: import transformers, load, one forward": (statistics.median(bare_seconds), 1.0),
            "tracer run --variant theta=10000 (report written), reference measurements cached": cached,
            "the same, first run of this model and prompt (noise floor and reference greedy measured)": first}


DECODE_PROMPT = "The capital of France is"
GREEDY_VARIANT = "rope=interleaved"  # flips at the 5th greedy token on SmolLM2: the old path's worst case


def decode_rows(model_dir: Path, steps: int, repeats: int) -> dict[str, tuple[float, float]]:
    """`--decode N` and the greedy check on the cache, each against the engines' own cached decodes
    timed in the same alternating rounds: transformers' `generate` (greedy, N tokens, no hook) and the
    reimplementation's cached decode with nothing recorded. (median seconds, median ratio)."""
    from tracer.comparison.diff import compare
    from tracer.comparison.result import Tolerance
    from tracer.engines.load import load_engine
    from tracer.engines.registry import EngineRef
    from tracer.model.knobs import parse_variant
    from tracer.pipeline import greedy
    from tracer.pipeline.decode import compare_decoded
    from tracer.pipeline.request import GREEDY_STEPS, Inputs, Request
    from tracer.pipeline.run import compare_candidate, prepared_reference

    request = Request(Inputs(model_dir, DECODE_PROMPT), greedy=0, progress=False).resolved()
    with prepared_reference(request) as prepared:
        hf, ids = prepared.engine, prepared.ids
        reimpl = load_engine(EngineRef.named("reimpl"), {}, prepared.target)
        prefill = compare_candidate(prepared, reimpl, local=False)
        rows = {}

        def generate():
            with torch.inference_mode():
                hf.model.generate(torch.tensor([ids]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False)

        def own_decodes():  # what generating costs on each side: the yardstick
            generate()
            reimpl.decode(ids, steps - 1, recorded=())

        rows[f"hf generate, {steps} tokens (no hook)"] = median_ratio(generate, own_decodes, repeats)
        rows[f"tracer run --decode {steps}: both decodes recorded, the floor, every step compared"] = median_ratio(
            lambda: compare_decoded(prefill, prepared, reimpl, steps), own_decodes, repeats)

        # The greedy check (20 tokens) of a candidate that parts early, before (uncached forwards, both sides
        # recorded uncached at the flip) and now (each side's cached decode, the flip step recorded).
        candidate = load_engine(EngineRef.named("reimpl"), parse_variant(GREEDY_VARIANT), prepared.target)
        count = GREEDY_STEPS

        def uncached_check():
            reference = greedy.continuation(hf, ids, count, guess=greedy.draft(hf, ids, count))
            parted = greedy.summary(reference, greedy.continuation(candidate, ids, count, guess=reference), str)
            flip_ids = ids + reference[:parted.first_flip - 1]
            return compare(hf.record(flip_ids), candidate.record(flip_ids), Tolerance()).first_divergence

        def cached_check():
            reference = greedy.generated(hf, ids, count)
            parted = greedy.summary(reference, greedy.generated(candidate, ids, count, guess=reference), str)
            steps_at_flip = [greedy.flip_step(side, ids, reference, parted.first_flip) for side in (hf, candidate)]
            return compare(*steps_at_flip, Tolerance()).first_divergence

        def generate_greedy():
            with torch.inference_mode():
                hf.model.generate(torch.tensor([ids]), max_new_tokens=count, min_new_tokens=count, do_sample=False)
            candidate.decode(ids, count - 1, recorded=())

        rows[f"greedy check, {GREEDY_VARIANT}, {count} tokens: uncached forwards (before)"] = median_ratio(
            uncached_check, generate_greedy, repeats)
        rows[f"greedy check, {GREEDY_VARIANT}, {count} tokens: each side's cache (now)"] = median_ratio(
            cached_check, generate_greedy, repeats)
    return rows


# The tiny models of the MoE rows: one size for both, the Mixtral's MLP four experts (two per token) of it.
MOE_SIZES = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, max_position_embeddings=512)


def moe_rows(tokens: int, repeats: int) -> dict[str, tuple[float, float]]:
    """Recording a tiny random Mixtral (4 experts, top-2) and a tiny random Llama of the same sizes, each
    engine (hf, reimpl) against its own plain forward of the same model in alternating rounds: what the
    routing points cost over a dense model's points."""
    import tempfile

    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    import tracer
    from tracer.reimpl.forward import Model
    from tracer.traces.trace import TraceRecorder

    ids = [(7 * i + 3) % MOE_SIZES["vocab_size"] for i in range(tokens)]
    rows: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory() as folder:
        mixtral = MixtralConfig(**MOE_SIZES, num_local_experts=4, num_experts_per_tok=2)
        for name, config, architecture in (("Llama", LlamaConfig(**MOE_SIZES), LlamaForCausalLM),
                                           ("Mixtral", mixtral, MixtralForCausalLM)):
            torch.manual_seed(0)
            model_dir = Path(folder) / name
            architecture(config).save_pretrained(model_dir)
            # the eager experts loop: what the hf engine loads and tracer mirrors
            experts = {"experts_implementation": "eager"} if name == "Mixtral" else {}
            hf = architecture.from_pretrained(model_dir, attn_implementation="eager", **experts).eval()
            reimpl, batch = Model.from_dir(model_dir), torch.tensor([ids])

            def plain(model=hf, batch=batch):
                with torch.inference_mode():
                    model(input_ids=batch, use_cache=False)

            recorded = best_times({"plain": plain, "hf": lambda model=hf: tracer.record(model, ids, engine="hf",
                                                                                       progress=False)}, repeats)
            rows[f"tiny {name}: tracer.record(engine='hf') against its plain forward"] = (
                recorded["hf"], recorded["hf"] / recorded["plain"])
            token_tensor = torch.tensor(ids)
            own = best_times({"bare": lambda m=reimpl: m.forward(token_tensor),
                              "recorded": lambda m=reimpl: m.forward(token_tensor, TraceRecorder())}, repeats)
            rows[f"tiny {name}: reimpl forward, every point recorded, against nothing recorded"] = (
                own["recorded"], own["recorded"] / own["bare"])
    return rows


def table(timings: dict[str, tuple[float, float] | str]) -> list[str]:
    """Rows of (seconds, ratio), or a tool's error instead of figures."""
    rows = ["| measurement | seconds | ratio |", "|---|--:|--:|"]
    for name, entry in timings.items():
        rows.append(f"| {name} | {entry} | |" if isinstance(entry, str)
                    else f"| {name} | {entry[0]:.3f} | {entry[1]:.2f}× |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repeats: 256 tokens, 3 repeats, "
                        "the bit-exact regimes at 64 and 256 tokens")
    parser.add_argument("--tokens", type=int, help="prompt length (default 512, quick 256)")
    parser.add_argument("--threads", type=int, help="torch and llama.cpp threads, here and in the timed processes "
                        "(default: each runtime's own)")
    parser.add_argument("--mlx-tokens", type=int, help=f"prompt length of the mlx rows (default {MLX_TOKENS}, "
                                                        f"quick {MLX_TOKENS_QUICK}: MLX's CPU build is slow)")
    parser.add_argument("--engines-only", action="store_true", help="only the runtime engines' rows")
    parser.add_argument("--regimes", action="store_true", help="only the number-format regime rows")
    parser.add_argument("--whole-run", action="store_true", help="only `tracer run` as a process against the bare "
                        "transformers script")
    parser.add_argument("--candle", action="store_true", help="only the candle engine's rows and candle's regime")
    parser.add_argument("--exact-tokens", type=int, nargs="+",
                        help="prompt lengths of the bit-exact regime rows (default 64 512 2048, quick 64 and "
                        "--tokens)")
    parser.add_argument("--moe", action="store_true", help="only the rows recording a tiny Mixtral beside a tiny "
                        "Llama of the same sizes")
    parser.add_argument("--decode", type=int, metavar="N", help="only the decode rows: `--decode N` and the greedy "
                        "check against both engines' own cached decodes (N tokens; the greedy check 20)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the whole-run processes
    import tracer

    model_dir = tracer.default_model_path()
    count = args.tokens or (256 if args.quick else 512)
    repeats = 3 if args.quick else 5
    mlx_count = args.mlx_tokens or (MLX_TOKENS_QUICK if args.quick else MLX_TOKENS)
    tokens = bench_tokens(model_dir, count)
    if args.whole_run:
        print("\n".join(table(whole_run(model_dir, 5 if not args.quick else 3))))
        return
    if args.moe:
        print("\n".join([f"# a mixture of experts against a dense model ({count} tokens, {torch.get_num_threads()} "
                         "threads); ratio: to the same engine's plain forward of the same model", ""]
                        + table(moe_rows(count, repeats))))
        return
    if args.decode:
        print("\n".join([f"# decode ({DECODE_PROMPT!r}, {torch.get_num_threads()} threads); ratio: to generate "
                         "with both engines' own caches, nothing recorded, in the same rounds", ""]
                        + table(decode_rows(model_dir, args.decode, repeats))))
        return
    if args.candle:
        rows = candle_rows(model_dir, tokens, repeats) or {"candle-nn": "not installed"}
        candle_regime = regimes(model_dir, tokens, repeats, (64,), candle_only=True)
        print("\n".join([f"# candle ({count} tokens; its bit-exact regime on 64)", ""] + table(rows) + [""]
                        + table(candle_regime)))
        return
    # The 2048-token bit-exact rows take minutes on a 2-core host (docs/measured.md): not what --quick is for.
    exact_counts = tuple(sorted(set(args.exact_tokens or ((64, count) if args.quick else EXACT_REGIME_TOKENS))))
    regime_rows = regimes(model_dir, tokens, repeats, exact_counts)
    regime_lines = [("| regime (reimpl forward, nothing recorded) | seconds (median) | ratio to the plain reimpl "
                     "forward (median of alternating rounds) |"),
                    "|---|--:|--:|"] + [f"| {name} | {s:.3f} | {r:.2f}× |" for name, (s, r) in regime_rows.items()]
    if args.regimes:
        print("\n".join(regime_lines))
        return
    machine = f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {platform.python_version()}"
    lines = [f"# tracer benchmark ({count} tokens, bundled SmolLM2, f32, {torch.get_num_threads()} threads; {machine})",
             ""]
    if not args.engines_only:
        forward, missing = in_process(model_dir, tokens, repeats)
        runs = whole_run(model_dir, 3)
        lines += table(forward) + [""]
        if missing:
            lines += [f"Not installed, so not measured: {', '.join(missing)}.", ""]
        lines += table(runs) + [""]
    engine_rows, engines_missing = runtime_engines(
        model_dir, {"onnx": tokens, "mlx": bench_tokens(model_dir, mlx_count)}, repeats)
    lines += ["Runtime engines, each against its own runtime's plain forward in alternating rounds:", ""] + engine_rows
    llamacpp = llamacpp_rows(model_dir, tokens, repeats, args.threads)
    if llamacpp is not None:
        lines += ["", "llama.cpp, against its own plain forward (the first row):", ""] + table(llamacpp)
    else:
        engines_missing.append("llama-cpp-python (the llamacpp engine)")
    candle = candle_rows(model_dir, tokens, repeats)
    if candle is not None:
        lines += ["", "candle, against its own plain forward:", ""] + table(candle)
    else:
        engines_missing.append("candle-nn (the candle engine)")
    if engines_missing:
        lines += ["", f"Runtimes not installed, so not measured: {', '.join(engines_missing)}."]
    lines += ["", "The llama.cpp and candle regimes (tracer.ggml), against the plain reimplementation forward:",
              ""] + regime_lines
    text = "\n".join(lines)
    print(text)
    (HERE / "results.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
