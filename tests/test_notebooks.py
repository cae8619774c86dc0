"""The example notebooks run top to bottom on the default model (executed with nbclient, as a reader would)."""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="needs the notebooks extra")
nbclient = pytest.importorskip("nbclient", reason="needs the notebooks extra")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))


def test_the_three_notebooks_exist():
    assert {p.stem for p in NOTEBOOKS} >= {"quickstart", "inside_the_codec", "perplexity_comparison"}


@pytest.mark.real_model
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, real_model):  # real_model: the converted model is cached before the kernel starts
    book = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        book, timeout=900, kernel_name="python3", resources={"metadata": {"path": EXAMPLES}}
    )
    client.execute()
    errors = [o for cell in book.cells if cell.cell_type == "code" for o in cell.outputs if o.output_type == "error"]
    assert not errors
