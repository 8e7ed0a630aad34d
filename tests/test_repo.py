"""tests/test_repo.py: the repository stands alone, as a fresh clone sees it.

- No file tracked by git names a path outside the repository (a folder beside the clone, a path
  on the machine it was written on, the specification and paper notes the code was first written
  from): a reader of a clone does not have them. The model is written down in docs/model.md.
- Every relative link in the tracked Markdown files (README.md, docs/*.md, ...) points at a file
  or folder tracked by git, and a link to a heading (file.md#anchor) at a heading that exists.
- Every function docs/model.md's equation index names is in the file of its column.
- Every test that README.md or docs/*.md names in backticks is a test function of tests/.

    python -m pytest -q tests/test_repo.py

Failures list every offence as path:line. Binary files (a NUL byte, or not UTF-8) are skipped;
in notebooks, sources and text outputs are checked, images are not (base64 can spell anything)."""
import json
import os
import re
import subprocess
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
