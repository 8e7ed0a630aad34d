"""Every notebook in notebooks/ runs top to bottom without an error and shows at least one plot.

A notebook added later is picked up by the glob. Each one is executed from a fresh kernel, in
memory (the committed file is not rewritten), with notebooks/ as the working directory, as Jupyter
would run it, and what it prints must be what the committed file shows: the same text and the same
numbers, so that a change to the code that moves a number fails here until the notebook is run
again, and its prose read again, and committed. The same numbers on any x86-64 machine and BLAS:
the few printed quantities whose digits depend on the CPU (finite-difference noise, the end of a
long float32 computation) are listed in MACHINE_DEPENDENT, each with the bound it must meet and
why, and are held to that bound instead of to their committed digits. The committed file must also
hold the outputs of a run: every code cell executed, no error among the outputs, no placeholder
text left in any cell, and every figure at least 400 pixels wide (readable on GitHub and in
JupyterLab).

    python -m pytest -q tests/test_notebooks.py
"""
import base64
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


MIN_FIGURE_WIDTH = 400                         # pixels, as displayed
PLACEHOLDER = re.compile(r"PLACEHOLDER|TODO|FIXME")
NUM = r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?"
NUMBER = re.compile(NUM)
SECONDS = re.compile(r"\s*m?s\b")              # after a number: a timing, which no two runs share
ROUNDING = 1e-6                                # below this, a printed number is a rounding error (a check's residual)


@dataclass(frozen=True)
class Bounded:
    """A printed quantity whose digits depend on the CPU and the BLAS. `pattern` finds it in a cell's
    text; its group "value" must be at most `bound` in size, and it and the group "name" (where the
    noise peaked, if the line says) may differ between machines. `why` says why it is not exact."""
    pattern: str
    bound: float
    why: str


# How a rerun's print is held to the committed one (disagreements, same_print): the words exactly;
# each number to its committed digits (to 1%, or to one unit of its last digit, which another CPU's
# rounding may move); a timing (a number followed by s or ms) not at all; two numbers below ROUNDING,
# residuals of an identity (1e-16 and the like), always agree; and the quantities listed here, per
# notebook, only to their bound, in the committed outputs and the rerun alike: their digits are
# noise that depends on the CPU and the BLAS.
MACHINE_DEPENDENT = {
    "02_backward_walkthrough.ipynb": [
        Bounded(rf"(?:max \|analytic - numeric\||values \+ query \+ key +max \|total - numeric\|) = (?P<value>{NUM})", 1e-7,
                "central differences (eps = 1e-6) err by rounding noise, whose digits follow the BLAS's order "
                "of additions; the prose promises a few 1e-8 at most"),
        Bounded(rf"worst \|analytic - numeric\| / \(1e-8 \+ 1e-5 \|numeric\|\) = (?P<value>{NUM}) \((?P<name>[\w.]+)\)",
                1.0, "dn.gradcheck's worst ratio is that noise over the check's bar, and the parameter where it "
                     "peaks moves with it (0.028 at gen.1.weight on one machine, 0.031 at h.0.mlp.c_proj.weight on "
                     "another); the cell says a ratio <= 1 passes"),
        Bounded(rf"largest error (?P<value>{NUM}) \((?P<name>[^)]*)\)", 1e-7,
                "the largest of the errors above, and the check it is in"),
        Bounded(rf"largest gradient entry (?P<value>{NUM}) \((?P<name>[^)]*)\)", 1e-5,
                "the largest error relative to its check's gradient, and where: within the checks' relative bar"),
    ],
    "04_synthetic_tasks.ipynb": [
        Bounded(rf"(?:train MSE \(last 50 steps\)|test MSE) (?P<value>{NUM})", 1.0,
                "the tiny live run: 150 float32 training steps, whose last digits follow the CPU's matmul "
                "kernels; on the standardised target, learning anything beats predicting the mean, MSE 1"),
    ],
    "05_training_results.ipynb": [
        Bounded(rf"the float32 checkpoint: {NUM}; difference (?P<value>{NUM})", 1e-4,
                "the float16 snapshot's score minus the committed one, both of 158,827 targets in float32: a "
                "difference in the last printed digit, which another CPU's rounding moves; the prose says it "
                "costs nothing measurable, below the results tables' 4 decimals"),
    ],
}


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


def last_digit(number):
    """One unit of the last digit a number was printed with ("0.07" -> 0.01, "2.4e-05" -> 1e-06), or
    None for a whole number, a count, which has no rounding to differ in."""
    mantissa, _, exponent = number.lower().partition("e")
    if "." not in mantissa and not exponent:
        return None
    return 10.0 ** (int(exponent or 0) - len(mantissa.partition(".")[2]))


def same_print(committed, rerun):
    """Whether two printed texts agree: the same words (spacing aside: a rounded zero may print as
    -0.00), and each number the same to 1%, or to one unit of its last printed digit (a number
    printed from floats may round the other way on another CPU), or both below ROUNDING; a number
    followed by "s" or "ms" is a timing and may be anything. A whole number must be the same to 1%."""
    def split(text):
        words, numbers, at = [], [], 0
        for match in NUMBER.finditer(text):
            words.append(re.sub(r"\s+", " ", text[at:match.start()]))
            timing = SECONDS.match(text, match.end()) is not None
            numbers.append(None if timing else match.group())
            at = match.end()
        return words + [re.sub(r"\s+", " ", text[at:])], numbers

    def agree(a, b):
        if a is None or b is None:
            return True
        x, y = float(a), float(b)
        units = [u for u in (last_digit(a), last_digit(b)) if u is not None]
        return (abs(x - y) <= 0.01 * max(abs(x), abs(y)) or max(abs(x), abs(y)) < ROUNDING
                or (len(units) == 2 and abs(x - y) <= max(units) * (1 + 1e-9)))
    (words_a, numbers_a), (words_b, numbers_b) = split(committed), split(rerun)
    return words_a == words_b and all(agree(a, b) for a, b in zip(numbers_a, numbers_b))


def disagreements(committed, rerun, bounded=()):
    """What keeps a cell's rerun text from agreeing with its committed text, [] when nothing does:
    each quantity of `bounded` (a notebook's MACHINE_DEPENDENT list), in either text, beyond its
    bound; and, with those quantities taken out of both, any difference same_print finds."""
    problems, texts = [], []
    for which, text in (("committed", committed), ("this run", rerun)):
        for quantity in bounded:
            for match in reversed(list(re.finditer(quantity.pattern, text))):
                if not abs(float(match.group("value"))) <= quantity.bound:
                    problems.append(f"{which}: {match.group()!r} is beyond its bound {quantity.bound:g} ({quantity.why})")
                spans = sorted((match.span(g) for g in ("value", "name") if g in match.re.groupindex), reverse=True)
                for start, end in spans:
                    text = text[:start] + "<machine-dependent>" + text[end:]
        texts.append(text)
    if not same_print(*texts):
        problems.append("a word or an exactly compared number differs")
    return problems


def test_same_print_tells_a_moved_number_from_a_timing():
    assert same_print("loss 2.413, ran in 5.1 s, err 3e-16", "loss 2.414, ran in 9.8 s, err 7e-15")
    assert not same_print("loss 2.413", "loss 2.513")
    assert not same_print("MHA is ahead", "DAMCHA is ahead")
    assert not same_print("took 5 steps", "took 6 steps")


def test_same_print_lets_the_last_digit_round_the_other_way():
    assert same_print("cos 0.06, rank 25.48, diff -0.0040, 2.4e-05", "cos 0.07, rank 25.49, diff -0.0039, 2.5e-05")
    assert same_print("cos(m, I):  0.00", "cos(m, I): -0.00")
    assert not same_print("cos 0.06", "cos 0.08")
    assert not same_print("diff -0.0040", "diff -0.0042")
    assert not same_print("7 of 16 heads", "8 of 16 heads")     # a count has no last digit to round


def test_a_machine_dependent_number_is_held_to_its_bound_and_the_rest_to_its_digits():
    # notebook 02's dn.gradcheck line as committed, and as a rerun on an AMD EPYC (OpenBLAS 0.3.31) printed it
    line = "dn.gradcheck, folded  : 32 parameter arrays, worst |analytic - numeric| / (1e-8 + 1e-5 |numeric|) = {} ({})\n"
    nb02 = MACHINE_DEPENDENT["02_backward_walkthrough.ipynb"]
    committed, elsewhere = line.format("0.028", "gen.1.weight"), line.format("0.031", "h.0.mlp.c_proj.weight")
    assert not same_print(committed, elsewhere)                 # digit by digit, the failure on that machine
    assert disagreements(committed, elsewhere, nb02) == []
    assert disagreements(committed, elsewhere.replace("32 parameter", "33 parameter"), nb02)   # an exact number moved
    assert disagreements(committed, elsewhere.replace("folded", "shared"), nb02)                # a word changed
    assert disagreements(committed, line.format("1.7", "gen.1.weight"), nb02)                   # beyond its bound
    assert disagreements(line.format("2.5", "gen.1.weight"), elsewhere, nb02)                   # committed beyond it
    assert disagreements(committed, elsewhere, []) == ["a word or an exactly compared number differs"]


@pytest.mark.parametrize("name", sorted(MACHINE_DEPENDENT))
def test_machine_dependent_quantities_are_printed_within_their_bounds(name):
    """Each listed quantity is printed by its notebook (a list entry that matches nothing would hide
    nothing and check nothing), and the committed value meets its bound."""
    nb = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    texts = printed(nb).values()
    for quantity in MACHINE_DEPENDENT[name]:
        assert any(re.search(quantity.pattern, text) for text in texts), f"{name}: nothing printed matches {quantity.pattern!r}"
    problems = [p for text in texts for p in disagreements(text, text, MACHINE_DEPENDENT[name])]
    assert not problems, f"{name}: " + "\n".join(problems)


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
        problems = disagreements(committed[n], text, MACHINE_DEPENDENT.get(path.name, []))
        assert not problems, (
            f"{path.name}, cell {n} prints what its committed output does not show ({'; '.join(problems)}): run the "
            f"notebook, read its prose against the new numbers, and commit it.\ncommitted:\n{committed[n]}\nthis run:\n{text}")
