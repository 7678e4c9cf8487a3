"""Every engine × every family, generated from the two tables (`tracer.engines.registry.ENGINES`,
`tracer.model.families.FAMILIES`) on the tiny models of tests/families.py, each cell held to what its
engine's entry states (`EngineEntry.cell`): `match` at every point the engine records; a runtime
difference diverging first at the point it declares, the hints saying it is the runtime's own behaviour;
or one line refusing the family, said before anything loads ("the ENGINE engine does not trace FAMILY yet",
or "the candle engine cannot trace ...: ..." for a family not in that runtime). An engine or a family
added later, or a cell an engine's entry changes, is tested by itself."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

import tracer
from tests.conftest import TOKENS
from tests.families import TINY_FAMILIES, with_hub_keys, write_tiny_family
from tests.unit.test_llamacpp_moe import LLAMACPP_HOLDS, converted
from tracer.core.errors import TracerError
from tracer.engines.registry import ABSENT, DIFFERS, ENGINES, NOT_YET
from tracer.model.families import FAMILIES
from tracer.model.points import TOP_K_INDEX

# Knobs a cell runs an engine with: llama.cpp's exact f32 path (its default f16 KV cache and fused
# flash attention are a number-format regime, judged by --regime, not a port to hold to f32).
CELL_VARIANTS = {"llamacpp": "kv_cache=f32,flash_attn=off"}


# Configs a cell runs a family on other than its tiny model's: what the runtime holds of the family
# (`LLAMACPP_HOLDS`: every layer of llama.cpp's qwen2moe sparse, its olmoe with as many KV heads as heads) and the
# config its declared difference shows on (norm_topk_prob, which llama.cpp's MoE graphs do not read; on the
# published configs they match: tests/unit/test_llamacpp_moe.py).
CELL_CONFIGS = {("llamacpp", "qwen2_moe"): dict(LLAMACPP_HOLDS["qwen2_moe"], norm_topk_prob=True),
                ("llamacpp", "olmoe"): dict(LLAMACPP_HOLDS["olmoe"], norm_topk_prob=True),
                ("llamacpp", "qwen3_moe"): dict(norm_topk_prob=False)}


def llamacpp_argument(family: str, model_dir, folder) -> str:
    """The tiny model as the f32 GGUF llama.cpp's converter writes (Llama and Mistral: its "llama" architecture); a
    mixture of experts by the converter itself ($LLAMACPP_SOURCE; tracer's writer has no MoE family)."""
    from tests.families import write_tiny_gguf as write_family_gguf
    from tests.tiny_gguf import write_tiny_gguf as write_llama_gguf

    path = folder / f"{family}.gguf"
    if family in ("llama", "mistral"):
        write_llama_gguf(model_dir, path)
    elif TOP_K_INDEX in FAMILIES[family].sub_points():
        return str(moe_ggufs(folder)[family])
    else:
        write_family_gguf(model_dir, path, no_vocab=True)
    return str(path)


def cell_model(engine: str, family: str, root) -> Path:
    """The model directory a cell runs: the family's tiny model (the `tiny` fixture's), or one written once with
    the cell's config (`CELL_CONFIGS`)."""
    if (engine, family) not in CELL_CONFIGS:
        return root / family
    path = root / f"{engine}-{family}"
    return path if (path / "config.json").is_file() else write_tiny_family(path, family, **CELL_CONFIGS[engine, family])


@functools.cache
def moe_ggufs(root) -> dict[str, Path]:
    """Every mixture of experts' llamacpp cell model as llama.cpp's converter writes it, all in one converter
    child (skipped where the converter is absent)."""
    moe = [family for family in FAMILIES if TOP_K_INDEX in FAMILIES[family].sub_points()]
    return converted({family: cell_model("llamacpp", family, root) for family in moe}, root)


def file_argument(family: str, model_dir, folder) -> str:
    """A trace saved earlier: the reference engine's own, so the cell checks the round trip."""
    path = folder / f"{family}.safetensors"
    tracer.record(model_dir, TOKENS, engine="hf", progress=False).save(path)
    return str(path)


# Cells whose runtime cannot load the tiny model every other cell of the family runs, and the model they run
# instead (docs/engine-mlx.md): mlx-lm's qwen2_moe.py makes every layer sparse (it reads no mlp_only_layers), and
# its qwen3_moe.py requires the keys the hub's configs carry (num_experts, a top-level rope_theta).
CELL_MODELS = {("mlx", "qwen2_moe"): lambda folder: write_tiny_family(folder / "mlx-qwen2_moe", "qwen2_moe",
                                                                      mlp_only_layers=[]),
               ("mlx", "qwen3_moe"): lambda folder: with_hub_keys(write_tiny_family(folder / "mlx-qwen3_moe",
                                                                                    "qwen3_moe"), "qwen3_moe")}

# How a cell names an engine that takes an argument (`engine:ARGUMENT`); the others run bare.
ARGUMENTS = {"llamacpp": llamacpp_argument, "file": file_argument}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny models, the same bytes every run: the onnx cells' exports, keyed by the models' contents,
    are made by the first run and reused by every later one, in the user's cache as a user's are."""
    root = tmp_path_factory.mktemp("matrix")
    return root, {family: write_tiny_family(root / family, family) for family in FAMILIES}


def test_every_family_has_a_tiny_model():
    assert set(TINY_FAMILIES) == set(FAMILIES)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("engine", list(ENGINES))
def test_cell(engine, family, tiny, monkeypatch):
    entry = ENGINES[engine]
    if entry.missing_runtime():
        pytest.skip(f"the {engine} runtime is not installed here")
    root, models = tiny
    models = {family: cell_model(engine, family, root)}
    cell = entry.cell(family)
    if cell in (NOT_YET, ABSENT):
        def must_not_load(*args, **kwargs):
            raise AssertionError("an engine loaded before the refusal")

        monkeypatch.setattr("tracer.pipeline.run.load_engine", must_not_load)
        with pytest.raises(TracerError) as refused:
            tracer.run(models[family], tokens=TOKENS, candidate=engine, greedy=0, progress=False)
        said = str(refused.value)
        start = f"the {engine} engine " + (f"does not trace {family} yet" if cell == NOT_YET else
                                            f"cannot trace {family}: ")
        assert said == entry.refusal(family) and said.startswith(start) and "\n" not in said and len(said) <= 100
        return
    if entry.argument_required or engine in ARGUMENTS:
        if engine not in ARGUMENTS:
            pytest.fail(f"say in ARGUMENTS how the matrix names the {engine} engine's {entry.argument}")
        candidate = f"{engine}:{ARGUMENTS[engine](family, models[family], root)}"
    else:
        candidate = engine
    model = CELL_MODELS[engine, family](root) if (engine, family) in CELL_MODELS else models[family]
    result = tracer.run(model, tokens=TOKENS, candidate=candidate, variant=CELL_VARIANTS.get(engine),
                        greedy=2, progress=False)
    if cell == DIFFERS:
        differences = entry.differences_on(family)
        points = {**FAMILIES[family].sub_points(), **FAMILIES[family].model_points()}
        assert all(difference.point in points for difference in differences), differences
        first = result.first_divergence
        shown = [difference for difference in differences if difference.at(first.point)]
        assert result.verdict == "diverged" and shown, (first, differences)
        assert shown[0].what in first.hints[0] and "not a porting mistake" in first.hints[0], first.hints
        return
    assert result.verdict == "match", (result.first_divergence, result.notes)
    # every point of the reference is compared, or its absence explained by the engine
    unexplained = [p.point for p in result.points if p.missing_on == "candidate" and not p.reason]
    assert unexplained == [], unexplained
    assert result.greedy is None or result.greedy.first_flip is None  # a saved trace decodes nothing
