"""Every notebook in notebooks/ runs top to bottom without an error and shows at least one plot.

A notebook added later is picked up by the glob. Each one is executed from a fresh kernel, in
memory (the committed file is not rewritten), with notebooks/ as the working directory, as Jupyter
would run it. The committed file must also hold the outputs of a run: every code cell executed."""
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def images(nb):
    return [out for cell in nb.cells if cell.cell_type == "code"
            for out in cell.get("outputs", []) if "image/png" in out.get("data", {})]


def test_there_are_notebooks():
    assert NOTEBOOKS, f"no notebooks found in {NOTEBOOK_DIR}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_with_outputs(path):
    nb = nbformat.read(path, as_version=4)
    unrun = [n for n, cell in enumerate(nb.cells) if cell.cell_type == "code" and cell.execution_count is None]
    assert not unrun, f"{path.name}: code cells {unrun} have not been executed; commit the notebook with its outputs"
    assert images(nb), f"{path.name}: the committed outputs hold no plot"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_runs_and_plots(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:                      # judge this run's outputs, not the committed ones
        if cell.cell_type == "code":
            cell.outputs = []
    # raises CellExecutionError, with the failing cell and its traceback, on the first error
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK_DIR)}}).execute()
    assert images(nb), f"{path.name}: no cell produced a plot (image/png output)"
