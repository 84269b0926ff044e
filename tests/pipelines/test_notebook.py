"""The notebook runs top to bottom against the local runner (the cluster cell is skipped without KFP_HOST)."""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_notebook_runs_locally(tmp_path, monkeypatch):
    monkeypatch.delenv("KFP_HOST", raising=False)
    monkeypatch.setenv("NOTEBOOK_RUN_ROOT", str(tmp_path))
    monkeypatch.setenv("NOTEBOOK_STEPS", "30")
    nb = nbformat.read(REPO / "notebooks" / "run_pipeline.ipynb", as_version=4)
    NotebookClient(nb, timeout=800, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    outputs = "".join(o.get("text", "") for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs)
    assert "compiled" in outputs and "val loss" in outputs and "HTML report:" in outputs
    assert "KFP_HOST is not set" in outputs
    assert (tmp_path / "pipeline.yaml").exists()
