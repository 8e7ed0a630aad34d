"""Every notebook in notebooks/ runs top to bottom without an error and shows at least one plot.

A notebook added later is picked up by the glob. Each one is executed from a fresh kernel, in
memory (the committed file is not rewritten), with notebooks/ as the working directory, as Jupyter
would run it, and what it prints must be what the committed file shows: the same text and the same
numbers (timings aside), so that a change to the code that moves a number fails here until the
notebook is run again, and its prose read again, and committed. The committed file must also hold
the outputs of a run: every code cell executed, no error among the outputs, no placeholder text
left in any cell, and every figure at least 400 pixels wide (readable on GitHub and in JupyterLab).

    python -m pytest -q tests/test_notebooks.py
"""
import base64
import re
import struct
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


MIN_FIGURE_WIDTH = 400                         # pixels, as displayed
PLACEHOLDER = re.compile(r"PLACEHOLDER|TODO|FIXME")
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")
SECONDS = re.compile(r"\s*m?s\b")              # after a number: a timing, which no two runs share
ROUNDING = 1e-6                                # below this, a printed number is a rounding error (a check's residual)


def images(nb):
    return [out for cell in nb.cells if cell.cell_type == "code"
            for out in cell.get("outputs", []) if "image/png" in out.get("data", {})]


def displayed_width(out):
    """The width in pixels at which a PNG output is shown: the width its metadata asks for (retina
    figures are stored at twice it), else the width in the PNG's header (IHDR: bytes 16-19)."""
    png = base64.b64decode(out["data"]["image/png"])
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR", "not a PNG"
    width = struct.unpack(">I", png[16:20])[0]
    return out.get("metadata", {}).get("image/png", {}).get("width", width)


def printed(nb):
    """Per code cell, the text it printed or returned (not a figure's "<Figure ...>" line)."""
    return {n: "".join(out.text if out.output_type == "stream" else out.data["text/plain"]
                       for out in cell.outputs
                       if out.output_type == "stream" or ("text/plain" in out.get("data", {}) and "image/png" not in out.data))
            for n, cell in enumerate(nb.cells) if cell.cell_type == "code"}


def same_print(committed, rerun):
    """Whether two printed texts agree: the same words, and each number the same to 1% (a figure of
    3 digits from another BLAS may differ in its last digit), or both below ROUNDING; a number
    followed by "s" or "ms" is a timing and may be anything."""
    def split(text):
        words, numbers, at = [], [], 0
        for match in NUMBER.finditer(text):
            words.append(text[at:match.start()])
            timing = SECONDS.match(text, match.end()) is not None
            numbers.append(None if timing else float(match.group()))
            at = match.end()
        return words + [text[at:]], numbers
    (words_a, numbers_a), (words_b, numbers_b) = split(committed), split(rerun)
    return words_a == words_b and all(
        a is None or b is None or abs(a - b) <= 0.01 * max(abs(a), abs(b)) or max(abs(a), abs(b)) < ROUNDING
        for a, b in zip(numbers_a, numbers_b))


def test_same_print_tells_a_moved_number_from_a_timing():
    assert same_print("loss 2.413, ran in 5.1 s, err 3e-16", "loss 2.414, ran in 9.8 s, err 7e-15")
    assert not same_print("loss 2.413", "loss 2.513")
    assert not same_print("MHA is ahead", "DAMCHA is ahead")
    assert not same_print("took 5 steps", "took 6 steps")


def test_there_are_notebooks():
    assert NOTEBOOKS, f"no notebooks found in {NOTEBOOK_DIR}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_with_outputs(path):
    nb = nbformat.read(path, as_version=4)
    unrun = [n for n, cell in enumerate(nb.cells) if cell.cell_type == "code" and cell.execution_count is None]
    assert not unrun, f"{path.name}: code cells {unrun} have not been executed; commit the notebook with its outputs"
    assert images(nb), f"{path.name}: the committed outputs hold no plot"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_placeholder_text(path):
    nb = nbformat.read(path, as_version=4)
    left = [(n, match.group()) for n, cell in enumerate(nb.cells) for match in [PLACEHOLDER.search(cell.source)] if match]
    assert not left, f"{path.name}: cells with placeholder text (cell, text): {left}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_committed_error(path):
    nb = nbformat.read(path, as_version=4)
    errors = [(n, out.get("ename") or "traceback on stderr") for n, cell in enumerate(nb.cells) if cell.cell_type == "code"
              for out in cell.outputs
              if out.output_type == "error" or (out.output_type == "stream" and "Traceback" in out.get("text", ""))]
    assert not errors, f"{path.name}: committed outputs hold errors (cell, error): {errors}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_figures_are_wide_enough(path):
    nb = nbformat.read(path, as_version=4)
    narrow = [(n, displayed_width(out)) for n, cell in enumerate(nb.cells) if cell.cell_type == "code"
              for out in cell.outputs if "image/png" in out.get("data", {}) and displayed_width(out) < MIN_FIGURE_WIDTH]
    assert not narrow, f"{path.name}: figures narrower than {MIN_FIGURE_WIDTH} px (cell, width): {narrow}"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_runs_and_plots(path):
    nb = nbformat.read(path, as_version=4)
    committed = printed(nb)
    for cell in nb.cells:                      # judge this run's outputs, not the committed ones
        if cell.cell_type == "code":
            cell.outputs = []
    # raises CellExecutionError, with the failing cell and its traceback, on the first error
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK_DIR)}}).execute()
    assert images(nb), f"{path.name}: no cell produced a plot (image/png output)"
    for n, text in printed(nb).items():
        assert same_print(committed[n], text), (
            f"{path.name}, cell {n} prints what its committed output does not show: run the notebook, "
            f"read its prose against the new numbers, and commit it.\ncommitted:\n{committed[n]}\nthis run:\n{text}")
