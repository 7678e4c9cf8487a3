"""The notebooks execute top to bottom on the bundled model (outputs are stripped in git)."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, default_model, tmp_path, monkeypatch):
    notebook = nbformat.read(path, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), "strip outputs"
    monkeypatch.chdir(tmp_path)
    NotebookClient(notebook, timeout=300, kernel_name="python3").execute()
    outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    assert "model.layers.0.self_attn.q_rope" in str(outputs)
