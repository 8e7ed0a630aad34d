"""tests/test_repo.py: the repository stands alone, as a fresh clone sees it.

- No file tracked by git names a path outside the repository (a folder beside the clone, a path
  on the machine it was written on, the specification and paper notes the code was first written
  from): a reader of a clone does not have them. The model is written down in docs/model.md.
- Every relative link in the tracked Markdown files (README.md, docs/*.md, ...) points at a file
  or folder tracked by git, and a link to a heading (file.md#anchor) at a heading that exists.
- Every function docs/model.md's equation index names is in the file of its column.
- Every test that README.md or docs/*.md names in backticks is a test function of tests/.
- The book (every Python file outside lab/ and tests/, and the notebooks) never imports the lab,
  found from the syntax tree, function-level imports included; only a notebook that presents a
  lab experiment may (NOTEBOOKS_THAT_SHOW_THE_LAB says which, and why). No import circles among
  the book's and the lab's modules. No function of the book over 60 lines but the trainer's
  train(). The reading path README.md lists is what the trainer imports. README.md at most 280
  lines.
- No comment or docstring of a .py file holds a date, a machine's record or a past run's figure,
  nor does README.md or docs/*.md, but beside a link to the record in results/.

    python -m pytest -q tests/test_repo.py

Failures list every offence as path:line. Binary files (a NUL byte, or not UTF-8) are skipped;
in notebooks, sources and text outputs are checked, images are not (base64 can spell anything)."""
import ast
import io
import json
import os
import re
import subprocess
import sys
import tokenize
from urllib.parse import unquote

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What a clone does not have. Each pattern is written with escapes (\/, \.) so that this file's
# own text does not match it.
OUTSIDE = [
    (re.compile(r"\.\.[\\/]shared\b"), "the folder beside the repository"),
    (re.compile(r"\/work\/"), "a path on the machine the code was written on"),
    (re.compile(r"\bshared\/(SPEC|paper)\b"), "the specification or paper notes, not in the repository"),
    # a bare mention is a dangling reference too: the reader has no such file to open
    (re.compile(r"\bSPEC\.md\b", re.IGNORECASE), "a specification file the repository does not have "
                                                "(the model is in docs/model.md)"),
    (re.compile(r"\bpaper\/000_[0-9a-f]+"), "the paper notes, not in the repository"),
]


def tracked_files():
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return sorted(p for p in out.decode().split("\0") if p)


def read_text(path):
    """The file's text, or None for a binary file."""
    with open(os.path.join(ROOT, path), "rb") as f:
        raw = f.read()
    if b"\0" in raw:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def text_parts(path, text):
    """(where, text) pieces to check: the whole file, or per notebook cell its source and text
    outputs, where = 'cell N' (0-based, as nbformat counts) or 'metadata'."""
    if not path.endswith(".ipynb"):
        return [("", text)]
    nb = json.loads(text)
    parts = [("metadata", json.dumps(nb.get("metadata", {}), indent=1))]
    for n, cell in enumerate(nb.get("cells", [])):
        pieces = [_joined(cell.get("source", ""))]
        for out in cell.get("outputs", []):
            pieces.append(_joined(out.get("text", "")))
            pieces += [_joined(v) for k, v in out.get("data", {}).items() if k.startswith("text/")]
            pieces += [out.get("ename", ""), out.get("evalue", ""), "\n".join(out.get("traceback", []))]
        parts.append((f"cell {n}", "\n".join(pieces)))
    return parts


def _joined(value):
    return "".join(value) if isinstance(value, list) else str(value)


def outside_references(text):
    """[(line number, matched text, why)] for every mention of a path outside the repository."""
    found = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for pattern, why in OUTSIDE:
            found += [(lineno, m.group(0), why) for m in pattern.finditer(line)]
    return found


def test_outside_references_finds_them():
    # the examples are put together from pieces, so that this file does not match itself
    shared, work, spec = ".." + "/shared", "/" + "work/", "SPEC" + ".md"
    text = f"ok: docs/model.md, ../results, spec_reference.py\nsee {shared}/{spec}\n'{work}main/x'\n"
    assert [(n, s) for n, s, _ in outside_references(text)] == [
        (2, shared), (2, "shared/" + "SPEC"), (2, spec), (3, work)]


def test_nothing_tracked_points_outside_the_repository():
    offences = []
    for path in tracked_files():
        text = read_text(path)
        if text is None:
            continue
        for where, part in text_parts(path, text):
            for lineno, match, why in outside_references(part):
                place = f"{path} {where}, line {lineno}" if where else f"{path}:{lineno}"
                offences.append(f"{place}: {match!r}: {why}")
    assert not offences, "tracked files name paths outside the repository:\n" + "\n".join(offences)


# ----------------------------------------------------------------------------------------------
# Markdown links

FENCE = re.compile(r"^\s{0,3}(```|~~~)")
CODE_SPAN = re.compile(r"(`+).*?\1")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^()\s<>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?([^\s>]+)>?")
HTML = re.compile(r"\b(?:href|src)\s*=\s*\"([^\"]+)\"")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def markdown_links(text):
    """[(line number, target)] of every link and image in Markdown text, outside code."""
    links, in_fence = [], False
    for lineno, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        line = CODE_SPAN.sub("", line)
        for pattern in (INLINE_LINK, REFERENCE, HTML):
            links += [(lineno, m.group(1)) for m in pattern.finditer(line)]
    return links


def heading_anchors(text):
    """The anchors GitHub gives the headings of Markdown text: lower case, punctuation dropped,
    spaces to hyphens; a repeated heading gets -1, -2, ..."""
    anchors, seen, in_fence = set(), {}, False
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
        m = None if in_fence else re.match(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            title = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))    # a link's text only
            slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
            anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def broken_links(path, text, tracked):
    """['path:line: why'] for each relative link of the Markdown file `path` that leads nowhere."""
    tracked_dirs = {os.path.dirname(p) for p in tracked}
    tracked_dirs |= {d for p in tracked_dirs for d in _parents(p)}
    broken = []
    for lineno, target in markdown_links(text):
        if SCHEME.match(target):
            continue                                       # http:, https:, mailto:
        file_part, _, anchor = unquote(target).partition("#")
        if file_part.startswith("/"):
            resolved = os.path.normpath(file_part.lstrip("/"))
        else:
            resolved = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
        resolved = resolved.replace(os.sep, "/")
        where = f"{path}:{lineno}: {target!r}"
        if resolved == ".." or resolved.startswith("../"):
            broken.append(f"{where} points outside the repository")
        elif resolved not in tracked and resolved not in tracked_dirs:
            broken.append(f"{where}: no tracked file or folder {resolved}")
        elif anchor and resolved.endswith(".md") and resolved in tracked:
            target_text = text if resolved == path else read_text(resolved)
            if anchor not in heading_anchors(target_text):
                broken.append(f"{where}: {resolved} has no heading with the anchor #{anchor}")
    return broken


def _parents(path):
    while path:
        path = os.path.dirname(path)
        yield path


def test_markdown_links_finds_them():
    text = ("# A title\n[ok](docs/model.md) ![img](a%20b.png \"t\") [web](https://arxiv.org)\n"
            "`[not](a link)`\n```\n[not](either)\n```\n[ref]: ../up.md\n[here](#a-title) [gone](#nope)\n")
    assert markdown_links(text) == [(2, "docs/model.md"), (2, "a%20b.png"), (2, "https://arxiv.org"),
                                    (7, "../up.md"), (8, "#a-title"), (8, "#nope")]
    assert heading_anchors("# Eq. 4: RowSum\n## The `x m` step\n## The `x m` step\n") == {
        "eq-4-rowsum", "the-x-m-step", "the-x-m-step-1"}
    broken = broken_links("README.md", text, {"README.md", "docs/model.md"})
    assert [b.split(":")[1] for b in broken] == ["2", "7", "8"]          # a b.png, ../up.md, #nope


def test_markdown_links_lead_somewhere():
    tracked = tracked_files()
    broken = []
    for path in tracked:
        if path.endswith(".md"):
            broken += broken_links(path, read_text(path), set(tracked))
    assert not broken, "broken relative links in the Markdown files:\n" + "\n".join(broken)


def test_the_equation_index_names_code_that_exists():
    """docs/model.md ends with an index from each equation to the functions that compute it, one column
    per model file. Every plain name in a column (`rowsum_backward`, `MetricQuery.backward`) must be
    a word of that file, so that a rename cannot leave the reader looking for code that is gone."""
    text = read_text("docs/model.md")
    index = text[text.index("## Index: equation to code"):]
    header = next(line for line in index.splitlines() if line.startswith("| equation"))
    files = re.findall(r"`(\w+\.py)`", header)
    assert files == ["damcha_numpy.py", "damcha_torch.py", "damcha_triton.py"], header
    sources = [read_text(f) for f in files]
    rows = [line for line in index.splitlines() if line.startswith("| ") and line != header and "---" not in line]
    missing, names = [], 0
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        assert len(cells) == 4, row
        for source, cell, path in zip(sources, cells[1:], files):
            for name in re.findall(r"`([A-Za-z_][\w.]*)`", cell):
                if name.split(".")[0] in ("F", "nn", "torch"):
                    continue   # torch's own functions
                names += 1
                missing += [f"{path}: {name}" for part in name.split(".")
                            if not re.search(rf"\b{re.escape(part)}\b", source)][:1]
    assert names > 50 and len(rows) >= 14
    assert not missing, "docs/model.md's index names what its file lacks:\n" + "\n".join(missing)


def test_every_test_the_docs_name_exists():
    """README.md and docs/*.md back their promises with tests named in backticks (`test_prompts_are_bytes`):
    each such name must be a test function of tests/, so that a rename cannot leave a promise
    pointing at nothing."""
    defined = {name for path in tracked_files() if path.startswith("tests/") and path.endswith(".py")
               for name in re.findall(r"^def (test_\w+)", read_text(path), re.MULTILINE)}
    named, missing = 0, []
    for path in tracked_files():
        if path == "README.md" or (path.startswith("docs/") and path.endswith(".md")):
            for n, line in enumerate(read_text(path).splitlines(), 1):
                for name in re.findall(r"`(test_\w+)`", line):
                    named += 1
                    missing += [f"{path}:{n}: {name}"] if name not in defined else []
    assert named > 20
    assert not missing, "tests named in the docs that tests/ does not define:\n" + "\n".join(missing)


# ----------------------------------------------------------------------------------------------
# The book and the lab (DEVELOPERS.md): the book is every Python file outside lab/ and tests/, and
# the notebooks; the lab imports the book, the book never imports the lab, and no module of either
# imports another that imports it back, not even from inside a function.

README_LINES = 280
BOOK_FUNCTION_LINES = 60
# A training run is one story, settings to the last step, as in nanoGPT's train.py: split into
# functions that pass its state around, it would be harder to follow, not easier.
LONG_BY_DESIGN = {("train_char.py", "train")}
# Notebooks that show a lab experiment, and so may import the lab, with the reason. Notebooks 05 and
# 06 show lab results too, but read them from results/: they need none of the lab's code.
NOTEBOOKS_THAT_SHOW_THE_LAB = {
    "notebooks/04_synthetic_tasks.ipynb": "it presents the synthetic study: the task definitions it checks and its "
                                          "live run are lab/synthetic.py's own functions, which a copy would duplicate",
}


def is_book(path):
    return not path.startswith(("lab/", "tests/")) and path.endswith((".py", ".ipynb"))


def module_name(path):
    """The dotted name a repository file is imported by: data/prepare.py -> data.prepare, lab/__init__.py -> lab."""
    return path[:-len(".py")].replace("/", ".").removesuffix(".__init__")


def python_source(path, text):
    """A .py file's text, or a notebook's code cells joined, with IPython's magics and shell lines
    (%matplotlib, !pip) blanked so that the code parses."""
    if not path.endswith(".ipynb"):
        return text
    cells = [_joined(cell.get("source", "")) for cell in json.loads(text).get("cells", []) if cell.get("cell_type") == "code"]
    return "\n".join(re.sub(r"^\s*[%!].*$", "", cell, flags=re.MULTILINE) for cell in cells)


def imported_names(source, module="", is_package=False):
    """[(line, dotted name)] of every import in the source, at any depth (inside functions too), as
    the names the import may load: `import a.b` -> a, a.b; `from a import b` -> a, a.b (b may be a
    module); a relative import is resolved against `module`, the file's own dotted name (a package's
    for an __init__.py); and importlib.import_module / __import__ of a constant string."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")[:len(module.split(".")) - node.level + is_package]
                base = ".".join(package + ([base] if base else []))
            names = [base] + [f"{base}.{alias.name}" if base else alias.name for alias in node.names]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")):
            names = [node.args[0].value]
        else:
            continue
        for name in names:
            parts = name.split(".")
            found += [(node.lineno, ".".join(parts[:k])) for k in range(1, len(parts) + 1) if parts[0]]
    return sorted(set(found))


def repository_modules(paths):
    """{dotted name: path} of the repository's Python modules, the book's and the lab's (not tests/)."""
    return {module_name(p): p for p in paths if p.endswith(".py") and not p.startswith("tests/")}


def lab_imports(path, text, lab_names):
    """[(line, name)] of the imports in a book file that load the lab: the package `lab`, a module in
    it, or a lab module under its bare name (reachable with lab/ put on sys.path; not a standard
    library module's name)."""
    found = imported_names(python_source(path, text), module_name(path), path.endswith("__init__.py"))
    return [(line, name) for line, name in found if name == "lab" or name.startswith("lab.")
            or (name in lab_names and name not in sys.stdlib_module_names)]


def import_cycles(sources):
    """The import circles among {path: source}: each a sorted list of 'path:line imports module'
    edges between the modules of one strongly connected component of the import graph."""
    modules = repository_modules(sources)
    edges = {m: {} for m in modules}                       # module -> {imported module: first line}
    for m, path in modules.items():
        for line, name in imported_names(sources[path], m, path.endswith("__init__.py")):
            if name in modules and name != m:
                edges[m].setdefault(name, line)
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(m):                                          # Tarjan's strongly connected components
        index[m] = low[m] = len(index)
        stack.append(m); on_stack.add(m)
        for n in edges[m]:
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in on_stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component, n = set(), None
            while n != m:
                n = stack.pop()
                on_stack.discard(n)
                component.add(n)
            components.append(component)
    for m in sorted(modules):
        if m not in index:
            visit(m)
    return [sorted(f"{modules[m]}:{line} imports {n}" for m in c for n, line in edges[m].items() if n in c)
            for c in components if len(c) > 1]


def long_functions(source, limit=BOOK_FUNCTION_LINES):
    """[(line, name, length)] of the functions and methods of the source longer than `limit` lines,
    from the def to the last line of the body."""
    return [(node.lineno, node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit]


def test_import_checks_find_every_form():
    lab = {"bench", "reproduce", "io"}
    book = ("import io\nimport laboratory\nfrom data import lab_notes\nimport lab\nfrom lab import bench\n"
            "from lab.reproduce import main\ndef f():\n    import lab.synthetic\n    import bench\n"
            "importlib.import_module('lab.counts')\n")
    assert lab_imports("book.py", book, lab) == [(4, "lab"), (5, "lab"), (5, "lab.bench"), (6, "lab"), (6, "lab.reproduce"),
                                                 (6, "lab.reproduce.main"), (8, "lab"), (8, "lab.synthetic"), (9, "bench"),
                                                 (10, "lab"), (10, "lab.counts")]
    notebook = json.dumps({"cells": [{"cell_type": "code", "source": ["%matplotlib inline\n", "from lab import synthetic\n"]},
                                     {"cell_type": "markdown", "source": "import lab"}]})
    assert lab_imports("n.ipynb", notebook, lab) == [(2, "lab"), (2, "lab.synthetic")]
    sources = {"a.py": "def f():\n    import b\n", "b.py": "import os\nfrom a import f\n", "c.py": "import a\n",
               "lab/__init__.py": "from .z import w\n", "lab/x.py": "from . import y\n", "lab/y.py": "import lab.x\n",
               "lab/z.py": "", "tests/t.py": "import c\n"}
    assert import_cycles(sources) == [["a.py:2 imports b", "b.py:2 imports a"],
                                      ["lab/x.py:1 imports lab.y", "lab/y.py:1 imports lab.x"]]
    assert import_cycles({"a.py": "import b\n", "b.py": "import os\n"}) == []


def test_long_functions_counts_from_def_to_the_last_line():
    body = lambda n: "def f():\n" + "    x = 1\n" * (n - 1)
    assert long_functions(body(60)) == [] and long_functions(body(61)) == [(1, "f", 61)]
    assert long_functions("class A:\n    " + body(61).replace("\n", "\n    ")) == [(2, "f", 61)]


def test_the_book_never_imports_the_lab():
    tracked = tracked_files()
    lab_names = {module_name(p).removeprefix("lab.") for p in tracked if p.startswith("lab/") and p.endswith(".py")}
    offences, shown = [], set()
    for path in tracked:
        if is_book(path):
            found = lab_imports(path, read_text(path), lab_names)
            if path in NOTEBOOKS_THAT_SHOW_THE_LAB:
                shown.add(path) if found else None
                continue
            offences += [f"{path}:{line}: imports {name}" for line, name in found]
    assert not offences, "the book imports the lab (the lab imports the book, never the other way):\n" + "\n".join(offences)
    stale = set(NOTEBOOKS_THAT_SHOW_THE_LAB) - shown
    assert not stale, f"NOTEBOOKS_THAT_SHOW_THE_LAB names notebooks that import no lab code: {sorted(stale)}"


def test_no_import_circles():
    sources = {p: read_text(p) for p in tracked_files() if p.endswith(".py")}
    circles = import_cycles(sources)
    assert not circles, "import circles (a function-level import hides one, it does not remove it):\n" + \
        "\n".join("  " + "; ".join(c) for c in circles)


def test_no_function_in_the_book_is_over_60_lines():
    """But the trainer's train(), which reads top to bottom as nanoGPT's train.py does (LONG_BY_DESIGN)."""
    offences = [f"{path}:{line}: {name} is {n} lines" for path in tracked_files() if is_book(path) and path.endswith(".py")
                for line, name, n in long_functions(read_text(path)) if (path, name) not in LONG_BY_DESIGN]
    assert not offences, f"functions of the book over {BOOK_FUNCTION_LINES} lines:\n" + "\n".join(offences)


# The reading path: the files that hold the PyTorch model and its training, which README.md lists
# in one sentence ("The **reading path** ..."). It is what `import train_char` really loads of the
# repository, neither more nor less.

def readme_reading_path():
    text = read_text("README.md")
    sentence = text[text.index("The **reading path**"):]
    sentence = sentence[:sentence.index(".\n")]
    return set(re.findall(r"`([\w/]+\.py)`", sentence))


def trainer_imports():
    """The repository's files (no package __init__.py) that importing train_char.py loads."""
    code = ("import json, sys; import train_char; "
            "print(json.dumps([getattr(m, '__file__', None) for m in list(sys.modules.values())]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    files = [os.path.relpath(f, ROOT) for f in json.loads(out.stdout) if f and f.startswith(ROOT + os.sep)]
    return {f.replace(os.sep, "/") for f in files if not f.endswith("__init__.py")}


def test_the_reading_path_is_what_the_trainer_imports():
    listed = readme_reading_path()
    assert "train_char.py" in listed and "damcha_torch.py" in listed, listed
    assert trainer_imports() == listed


def test_readme_is_at_most_280_lines():
    n = len(read_text("README.md").splitlines())
    assert n <= README_LINES, f"README.md has {n} lines, more than {README_LINES}: records belong in results/ and docs/"


# ----------------------------------------------------------------------------------------------
# Comments say why, never when: no dates, machines or past runs in a .py file's comments and
# docstrings (they belong in results/<name>/README.md). Each rule is written to match a record and
# not the plain words a why-comment uses (an H100's peak FLOP/s, a kernel compiled for an H200).

MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.?"
FIGURE = r"\d[\d,.]*(?:\s*-\s*\d[\d,.]*)?\s*(?:[KMG]iB|[MG]B|bytes|ms|s|sec|seconds?|min|minutes?|hours?)\b"
MACHINE = r"\b(?:[GH]?H100|H200|GH200|B200|A100|V100|RTX\s?\d{4}|EPYC|Xeon|Ryzen|AMD|Intel)\b"
RECORDS = [
    (re.compile(r"\b(?:19|20)\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b"), "a date"),
    (re.compile(rf"\b{MONTH}\s+(?:\d{{1,2}},?\s+)?(?:19|20)\d\d\b|\b\d{{1,2}}\s+{MONTH}\s+(?:19|20)\d\d\b"), "a date"),
    (re.compile(r"\bon\s+(?:\d+|one|two|three|four|eight|sixteen)\s+(?:CPU\s+)?cores?\b", re.IGNORECASE), "a machine's cores"),
    (re.compile(r"\b(?:was|were)\s+seen\b|\bseen\s+once\b|\bon\s+the\s+last\s+(?:\w+\s+)?run\b", re.IGNORECASE), "a past run"),
    (re.compile(rf"\btook\b[^.;]{{0,40}}?{FIGURE}"), "a past run's time or memory"),
    (re.compile(rf"{FIGURE}[^.;]{{0,120}}?{MACHINE}|{MACHINE}[^.;]{{0,120}}?{FIGURE}"), "a figure measured on a machine"),
]


def comments_and_docstrings(source):
    """[(line, text)] of a Python source's comment blocks (consecutive comment lines, joined) and
    docstrings (module, class, function)."""
    blocks = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            line, text = token.start[0], token.string.lstrip("#")
            if blocks and blocks[-1][0] + blocks[-1][1].count("\n") == line - 1 and blocks[-1][2]:
                blocks[-1] = (blocks[-1][0], blocks[-1][1] + "\n" + text, True)
            else:
                blocks.append((line, text, True))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node):
            first = node.body[0]
            blocks.append((first.lineno, first.value.value, False))
    return sorted((line, text) for line, text, _ in blocks)


def records(text):
    """[(line within the text, 1-based; what matched; why it is a record)]."""
    return sorted((text[:m.start()].count("\n") + 1, " ".join(m.group().split()), why)
                  for pattern, why in RECORDS for m in pattern.finditer(text))


def test_records_finds_dates_machines_and_past_runs():
    # records as they once stood in the code (some joined from two lines), and two dates
    for text in ["a row took 83-85 s on the last run", "TRAIN_ROW_S = 100: 83-85 s on the last H200 run",
                 "saving and sampling was seen (once, under gloo) to abort at its exit",
                 "stayed alive together until the sum, 9,630 MiB peak on an\n    H200 against eager's 5,644 MiB",
                 "torch's meta init functions took 49 of count_params's 57 ms", "(about a minute on two CPU cores)",
                 "(On an H200 this measured exactly those three: 4,259,840 bytes.)",
                 "fixed on 2026-11-30", "as of Nov 2026", "run on 30 November 2026", "on 2 cores"]:
        assert records(text), text
    for text in ["Dense peak FLOP/s of one H100 / H200 SXM (the same Hopper tensor cores)",
                 "every Triton kernel compiled for an H100 / H200 (sm_90)", "never one that an earlier run left in the file",
                 "A 1 MiB tmpfs: a real file system that runs full", "hence torch >= 2.4, the first release built with it",
                 "-n 2 runs a process per core", "m (B, T, H, dh, dh) in float32 is 2048 bytes", "May 2 layers share it"]:
        assert not records(text), text
    assert [line for line, _, _ in records("why\nwhy\nfixed on 2026-11-30\n")] == [3]


def markdown_paragraphs(text):
    """[(first line, paragraph)] of Markdown text, code blocks included: blank lines part them."""
    paragraphs, start, lines = [], 1, []
    for n, line in enumerate(text.splitlines() + [""], 1):
        if line.strip():
            start, lines = (n, [line]) if not lines else (start, lines + [line])
        elif lines:
            paragraphs.append((start, "\n".join(lines)))
            lines = []
    return paragraphs


def test_no_history_in_the_readme_or_docs():
    """README.md and docs/*.md describe what is, not what happened: no date, no machine's record, no
    past run's figure, but in a paragraph that links to its record in results/ (a figure with its
    source). The records themselves live in results/<name>/README.md."""
    offences = []
    for path in tracked_files():
        if path == "README.md" or (path.startswith("docs/") and path.endswith(".md")):
            for start, paragraph in markdown_paragraphs(read_text(path)):
                if "results/" not in paragraph:
                    offences += [f"{path}:{start + line - 1}: {match!r}: {why}"
                                 for line, match, why in records(paragraph)]
    assert not offences, ("records in the README or docs (they belong in results/<name>/README.md, "
                          "linked from the text):\n" + "\n".join(offences))


def test_no_dates_machines_or_past_runs_in_source_comments():
    offences = []
    for path in tracked_files():
        if path.endswith(".py"):
            for start, text in comments_and_docstrings(read_text(path)):
                offences += [f"{path}:{start + line - 1}: {match!r}: {why}" for line, match, why in records(text)]
    assert not offences, ("records in comments or docstrings (a comment says why; what was measured when belongs in "
                          "results/<name>/README.md):\n" + "\n".join(offences))


def test_tests_say_what_they_test_not_which_issue_asked():
    """A clone has no tracker: a test's docstring or comment names what it checks, never an issue."""
    asked = re.compile(r"\b(?:issue|ticket)\s*#?\d+|\bthe issue'?s?\b", re.IGNORECASE)
    offences = [f"{path}:{n}: {line.strip()}" for path in tracked_files()
                if path.startswith("tests/") and path.endswith(".py")
                for n, line in enumerate(read_text(path).splitlines(), 1)
                if asked.search(line) and "asked = re.compile" not in line]
    assert not offences, "tests that cite the tracker:\n" + "\n".join(offences)

