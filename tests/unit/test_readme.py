"""The README's two commands stay true: CI runs the test command exactly as written."""

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    return re.findall(r"```sh\n(python3 -m venv[^\n]*)\n```", (ROOT / "README.md").read_text())


def test_readme_has_exactly_two_setup_commands():
    main_job, tests = readme_commands()
    assert main_job.endswith("tracer run --variant theta=10000")
    assert "pip install -q torch==2.13.0" in main_job.split("&&")[2]  # the CPU build before anything pulls torch
    assert tests.endswith("python -m pytest")


def test_ci_runs_the_readme_test_command():
    assert readme_commands()[1] in (ROOT / ".ci" / "run").read_text().splitlines()


def linked_docs() -> str:
    """The README and every page of docs/ it links to."""
    readme = (ROOT / "README.md").read_text()
    pages = sorted(set(re.findall(r"\]\((docs/[\w.-]+\.md)\)", readme)))
    return "\n".join([readme, *((ROOT / page).read_text() for page in pages)])


def test_readme_is_read_in_five_minutes():
    assert len((ROOT / "README.md").read_text()) <= 12_000


def commands() -> dict:
    """sub-command -> its argparse parser."""
    from tracer.cli import build_parser

    subparsers = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    return dict(subparsers.choices)


def usage_lines() -> dict[str, str]:
    """sub-command -> its lines in the README's usage block (a `tracer X` line and its continuations)."""
    readme = (ROOT / "README.md").read_text()
    block = next(b for b in re.findall(r"```sh\n(.*?)```", readme, flags=re.S) if b.startswith("tracer run"))
    return {m.group(1): m.group(0) for m in re.finditer(r"^tracer (\w+).*(?:\n(?!tracer ).*)*", block, flags=re.M)}


def long_flags(parser) -> list[str]:
    return [flag for action in parser._actions for flag in action.option_strings
            if flag.startswith("--") and flag != "--help"]


def test_the_usage_block_shows_every_command_with_every_flag():
    lines = usage_lines()
    assert set(lines) == set(commands())
    missing = [f"tracer {command} {flag}" for command, parser in commands().items() for flag in long_flags(parser)
               if not re.search(re.escape(flag) + r"(?![\w-])", lines[command])]
    assert missing == []


def test_every_flag_is_explained_in_the_readme_or_a_page_it_links():
    text = "\n".join(line for line in linked_docs().splitlines() if not line.startswith("tracer "))
    missing = sorted({flag for parser in commands().values() for flag in long_flags(parser)
                      if not re.search(re.escape(flag) + r"(?![\w-])", text)})
    assert missing == []


def test_the_three_recipes_are_valid_commands_and_installs():
    """Each recipe line parses as a tracer command or is an engine's install command, flags included
    (the integration tests run them: test_runtimes_smollm2, test_ggml_smollm2, test_foreign_traces)."""
    from tests.readme import recipes
    from tracer.cli import build_parser
    from tracer.engines.registry import ENGINES

    found = recipes()
    assert list(found) == ["A live runtime", "A GGUF", "A dump from your code"]
    installs = {entry.install for entry in ENGINES.values()}
    for line in (line for lines in found.values() for line in lines):
        if line.startswith("tracer "):
            build_parser().parse_args(shlex.split(line)[1:])
        else:
            assert line in installs, line


def test_a_missing_extra_is_named_with_the_readmes_install_command():
    from tracer.engines.registry import ENGINES

    readme = (ROOT / "README.md").read_text()
    llamacpp = ENGINES["llamacpp"].install
    assert llamacpp in readme and "-mno-amx-int8" in llamacpp and "--no-cache-dir" in llamacpp
    assert ENGINES["onnx"].install in readme
    for entry in ENGINES.values():  # the others: the same line with their extra
        if entry.extra and not entry.install_env:
            assert entry.install == ENGINES["onnx"].install.replace("onnx", entry.extra)
