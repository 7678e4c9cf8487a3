"""The notebooks execute top to bottom on the bundled model (outputs are stripped in git)."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

FOLDER = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = sorted(path.name for path in FOLDER.glob("*.ipynb"))
REQUIRES = {"candle_port.ipynb": "candle"}  # notebooks that run an optional runtime: its import name


@pytest.fixture(scope="module")
def executed(default_model, tmp_path_factory):
    """name -> the notebook executed top to bottom, each executed once in the module and kept (its story
    test reads what `test_notebook_runs_without_errors` ran).

    The notebooks run one after another in one kernel, as a user's Jupyter session would run them: before
    each, the kernel's namespace is reset (`%reset -f`: a name one notebook defined is not there for the next)
    and its working folder is the notebook's own; the imports a kernel already made are not made again."""
    from jupyter_client import KernelManager

    done, kernel = {}, KernelManager(kernel_name="python3")

    def execute(name: str):
        if name in REQUIRES:
            pytest.importorskip(REQUIRES[name])
        if name not in done:
            notebook = nbformat.read(FOLDER / name, as_version=4)
            code = [cell for cell in notebook.cells if cell.cell_type == "code"]
            assert all(not cell.get("outputs") for cell in code), "strip outputs"
            assert all(cell.get("execution_count") is None for cell in code)
            workdir = tmp_path_factory.mktemp(Path(name).stem)
            fresh = nbformat.v4.new_code_cell(f"%reset -f\nimport os as _os\n_os.chdir({str(workdir)!r})\ndel _os")
            notebook.cells.insert(0, fresh)
            NotebookClient(notebook, km=kernel, timeout=600, resources={"metadata": {"path": str(workdir)}}).execute()
            assert not fresh.outputs, fresh.outputs
            del notebook.cells[0]
            done[name] = notebook
        return done[name]

    yield execute
    if kernel.has_kernel:
        kernel.shutdown_kernel(now=True)


def outputs(notebook) -> list:
    return [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs]


def story(executed, notebook: str) -> list:
    """The outputs of `notebook`, the one a story test reads."""
    assert notebook in NOTEBOOKS
    return outputs(executed(notebook))


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_without_errors(executed, name):
    shown = outputs(executed(name))
    assert not [out for out in shown if out.output_type == "error"]
    stderr = " ".join(out.text for out in shown if out.output_type == "stream" and out.name == "stderr")
    assert "Warning" not in stderr and "Traceback" not in stderr


def test_rope_theta_story_shows_rich_outputs(executed):
    shown = story(executed, "rope_theta.ipynb")
    data = [out.get("data", {}) for out in shown]
    html = [d["text/html"] for d in data if "text/html" in d]
    assert any('class="tracer-nb"' in h and "model.layers.0.self_attn.q_rope" in h and "DIVERGED" in h for h in html)
    assert any("Trace</b> <code>reimpl[theta=10000]</code>" in h for h in html)
    assert sum("image/png" in d for d in data) >= 2  # result.plot() and result.plot("breakdown")
    # the long steps show tqdm's notebook widget
    assert any("application/vnd.jupyter.widget-view+json" in d for d in data)
    assert "model.layers.0.self_attn.q_rope" in str(shown)


def test_candle_port_walks_theta_rope_i_and_the_gguf_in_candles_regime(executed):
    text = str(story(executed, "candle_port.ipynb"))
    assert "took rope_theta = 10000" in text and "first divergence model.layers.0.self_attn.q_rope" in text
    assert "read as transformers reads it: match" in text
    assert "match - largest difference over 513 points: 0.0" in text


def test_decode_story_finds_the_cache_bug_by_step(executed):
    shown = story(executed, "decode.ipynb")
    text = str(shown)
    assert "prompt: match" in text and "where the sides part: model.layers.0.self_attn.q_rope" in text
    assert "first divergence: decode step 1 (position 5), model.layers.0.self_attn.q_rope" in text
    assert "model.layers.0.self_attn.q_proj 0.0" in text  # the projection agrees, RoPE does not
    html = [out.get("data", {}).get("text/html", "") for out in shown]
    assert any('class="tracer-nb"' in h and "DIVERGED" in h for h in html)


def test_moe_story_shows_the_routing_agreeing_where_the_weights_differ(executed):
    shown = story(executed, "moe_routing.ipynb")
    printed = " ".join(out.text for out in shown if out.output_type == "stream" and out.name == "stdout")
    assert "model.layers.0.mlp.gate.top_k_weights" in printed and "routing: 100% of 14 token-layers agree" in printed
    assert "model.layers.0.mlp.experts" in printed and "layer 0 routing agreement: 1.0" in printed
    assert any("image/png" in out.get("data", {}) for out in shown)  # the layer × token map
