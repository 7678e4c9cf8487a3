"""Every code block of README.md and docs/ runs in the suite, or says beside it why it cannot.

A page's block carries a mark on the line before it: `<!-- run by: tests/FILE.py::test_name -->`
(a test that runs it as written) or `<!-- not run: the reason -->`. The README has no room for
marks (test_readme: 12,000 characters at most): its blocks are listed here. The dump writers of
docs/trace-format.md run here, as written, on a model the way a user has one: a stock transformers
Llama saved with `save_pretrained` (no tokenizer), against the trace `tracer record` makes of it.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import tracer
from tests.conftest import TOKENS
from tests.families import write_tiny_family

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"<!-- (?:run by: (?P<test>\S+)|not run: (?P<reason>.+)) -->")

# README.md's blocks in order: what runs each, or why none can.
README = [
    ("python3 -m venv", "not run: installs torch and the package from the network; "
                        "tests/integration/test_smollm2.py runs its `tracer run --variant theta=10000`"),
    ("python3 -m venv", "run by: tests/unit/test_readme.py::test_ci_runs_the_readme_test_command"),
    ("pip install -e '.[onnx]'", "run by: tests/integration/test_runtimes_smollm2.py::"
                                 "test_onnx_records_all_513_points_and_matches"),
    ("CMAKE_ARGS=", "run by: tests/integration/test_ggml_smollm2.py::"
                    "test_regime_auto_reads_llama_cpp_as_correct_and_keeps_the_raw_view"),
    ("tracer record --model", "run by: tests/integration/test_foreign_traces.py::"
                              "test_the_readme_dump_recipe_localizes_the_same_fault"),
    ("tracer: hf vs reimpl", "run by: tests/integration/test_smollm2.py::"
                             "test_cli_main_job_prints_what_the_readme_shows_and_writes_the_report"),
    ("tracer run [--model", "run by: tests/unit/test_readme.py::"
                            "test_the_usage_block_shows_every_command_with_every_flag"),
    ("import torch", "run by: tests/integration/test_examples.py::test_python_blocks_run"),
]


def blocks(page: str) -> list[tuple[str, str, str]]:
    """(language, code, the mark before it: "" for none) of each fenced block of `page`."""
    text = (ROOT / page).read_text()
    found = []
    for match in re.finditer(r"^```(\w*)\n(.*?)^```$", text, flags=re.S | re.M):
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        found.append((match.group(1), match.group(2), before if MARK.fullmatch(before) else ""))
    return found


def code(page: str, starts: str) -> str:
    """The one block of `page` that starts with `starts`."""
    [found] = [c for _, c, _ in blocks(page) if c.startswith(starts)]
    return found


def test_every_block_of_the_docs_is_marked():
    unmarked = [f"{page}: {c.splitlines()[0][:60]}" for page in PAGES[1:] for _, c, mark in blocks(page) if not mark]
    assert unmarked == []


def test_the_readme_blocks_are_the_listed_ones():
    found = [c for _, c, _ in blocks("README.md")]
    assert len(found) == len(README)
    assert all(c.startswith(starts) for c, (starts, _) in zip(found, README, strict=True))


def test_each_run_by_mark_names_an_existing_test():
    marks = [mark for page in PAGES[1:] for *_, mark in blocks(page)] + [f"<!-- {m} -->" for _, m in README]
    missing = []
    for mark in marks:
        test = MARK.fullmatch(mark).group("test")
        if test:
            path, name = test.split("::")
            if not (ROOT / path).is_file() or f"def {name}(" not in (ROOT / path).read_text():
                missing.append(test)
        else:
            assert len(MARK.fullmatch(mark).group("reason")) > 5, mark  # a reason, not a shrug
    assert missing == []


@pytest.fixture(scope="module")
def user_model(tmp_path_factory):
    """A stock transformers Llama as its user has it (`save_pretrained`, no tokenizer), and the
    reference trace `tracer record` makes of it on TOKENS."""
    folder = write_tiny_family(tmp_path_factory.mktemp("user") / "my-model", "llama")
    reference = tracer.record(folder, TOKENS, engine="hf", progress=False)
    path = folder.parent / "hf.safetensors"
    reference.save(path)
    return folder, reference, path


def run_block(source: str, folder: Path, **names) -> dict:
    """Run a page's Python block as written in `folder`, with the names the page leaves to its user."""
    scope = {"__name__": "__doc_block__", **names}
    with contextlib.chdir(folder):
        exec(compile(source, "doc block", "exec"), scope)
    return scope


def test_the_numpy_and_torch_dumps_match(user_model, tmp_path):
    from transformers import AutoModelForCausalLM

    folder, reference, hf_path = user_model
    page = "docs/trace-format.md"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    run_block(code(page, "import json\nimport torch"), tmp_path, model=model, token_ids=TOKENS)
    result = tracer.compare_files(reference, tmp_path / "port.safetensors")
    assert result.verdict == "match"
    assert {p.point for p in result.points if p.recorded} >= {"model.layers.0.mlp.down_proj", "lm_head"}
    # transformers' own activation module is named as such, not left to an aliases file that would mis-map it
    assert ("candidate: model.layers.0.mlp.act_fn, model.layers.1.mlp.act_fn, model.layers.2.mlp.act_fn not "
            "compared: transformers' activation module, act(gate_proj) alone; tracer's mlp.act is "
            "act(gate_proj)·up_proj") in result.notes
    assert not any("match no alias" in note for note in result.notes), result.notes

    (tmp_path / "port.safetensors").unlink()
    run_block(code(page, "import json\nimport numpy"), tmp_path, token_ids=TOKENS,
              hidden0=reference["model.layers.0"].numpy(), hidden1=reference["model.layers.1"].numpy(),
              logits=reference["lm_head"].numpy())
    result = tracer.compare_files(reference, tmp_path / "port.safetensors")
    assert result.verdict == "match"
    assert {p.point for p in result.points if p.recorded} == {"model.layers.0", "model.layers.1", "lm_head"}

    # the porting-CI block: its test, at the paths it names, passes on a copy and fails on a fault
    (tmp_path / "tests" / "data").mkdir(parents=True)
    (tmp_path / "target").mkdir()
    shutil.copy(hf_path, tmp_path / "tests" / "data" / "hf.safetensors")
    shutil.copy(tmp_path / "port.safetensors", tmp_path / "target" / "port.safetensors")
    scope = run_block(code(page, "from tracer.testing"), tmp_path)
    with contextlib.chdir(tmp_path):
        scope["test_port_matches_transformers"]()
        save_file({"l_out-1": reference["model.layers.1"] * 1.01}, "target/port.safetensors",
                  metadata={"tokens": json.dumps(TOKENS)})
        with pytest.raises(AssertionError, match="model.layers.1"):
            scope["test_port_matches_transformers"]()


def test_the_aliases_example_maps_a_dump(user_model, tmp_path):
    _, reference, _ = user_model
    (tmp_path / "names.json").write_text(code("docs/trace-format.md", '{"layer{i}'))
    dump = {"layer0/mlp_out": reference["model.layers.0.mlp.down_proj"], "final_hidden": reference["model.norm"],
            "debug_tmp-0": torch.zeros(3), "tokens": torch.tensor(TOKENS)}
    result = tracer.compare_files(reference, dump, aliases=tmp_path / "names.json")
    assert result.verdict == "match"
    assert {p.point for p in result.points if p.recorded} == {"model.layers.0.mlp.down_proj", "model.norm"}
    assert "candidate: debug_tmp-0 not compared: ignored by the aliases file" in result.notes  # null: on purpose


def test_the_hook_recipe_without_its_copy_is_what_safetensors_refuses(user_model, tmp_path):
    """Why the page's recipe copies: the recipe with `.contiguous()` in place of the copy fails."""
    from transformers import AutoModelForCausalLM

    folder, _, _ = user_model
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    source = code("docs/trace-format.md", "import json\nimport torch")
    copying = ".clone(memory_format=torch.contiguous_format)"
    assert copying in source
    with pytest.raises(RuntimeError, match="share memory"):
        run_block(source.replace(copying, ".contiguous()"), tmp_path, model=model, token_ids=TOKENS)


def test_the_pages_name_the_ids_a_model_without_a_tokenizer_is_fed():
    from tracer.pipeline.request import DEFAULT_TOKENS

    ids = ",".join(map(str, DEFAULT_TOKENS))
    assert f"no tokenizer: {ids})" in (ROOT / "README.md").read_text()
    assert f"`{ids}`" in (ROOT / "docs" / "trace-format.md").read_text()
