"""The user's pages: README.rst stays short, no page is over 600 lines or reads like
a build log, docs/benchmarks holds only the results a page cites, and the generated
tables cover every variable the code reads.

Sphinx itself builds the pages with warnings as errors in tools/test.sh; these are
the checks Sphinx cannot make. The error messages' page: tests/docs/test_docs_errors.py.
"""

from __future__ import annotations

import ast
import re

import pytest
import util

pytestmark = util.serial_only

DOCS = util.ROOT / "docs"
README = util.ROOT / "README.rst"
# At most about 250 lines: what a cluster user reads in two minutes.
README_MAX_LINES = 250

# What a page a user reads must not say: commit hashes, the project's own work
# sessions and machine. (Benchmarks name their machine by its description.)
_LOG_TALK = [
    # (A retired benchmark's command names its last tree, ``<commit>:benchmarks``.)
    (re.compile(r"(?<![\w./-])[0-9a-f]{7,40}(?![\w/-]|:benchmarks)"), "a commit hash"),
    (
        re.compile(
            r"\b(this|an earlier|a previous|the previous|a later|the next|last) "
            r"session\b",
            re.I,
        ),
        "a session",
    ),
    (re.compile(r"\b(this|our|the project's) (own )?machine\b", re.I), "our machine"),
    (re.compile(r"\bthis project's\b", re.I), "the project's own doings"),
    (re.compile(r"\ban earlier run\b", re.I), "a log of runs"),
    (re.compile(r"\bnot explained yet\b", re.I), "an unexplained guess"),
]


def user_pages() -> list:
    return [README, *sorted(DOCS.glob("*.rst"))]


def log_talk(text: str) -> list[str]:
    """Return ``"line N: <what> (<the words>)"`` for every match in ``text``."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern, what in _LOG_TALK:
            for match in pattern.finditer(line):
                # A number of seven digits or more is not a hash.
                if what == "a commit hash" and match.group().isdigit():
                    continue
                found.append(f"line {number}: {what} ({match.group()!r})")
    return found


def test_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.rst has {lines} lines; keep it to {README_MAX_LINES} and move the "
        f"rest into docs/"
    )


@pytest.mark.parametrize("page", user_pages(), ids=lambda p: p.name)
def test_page_is_not_a_build_log(page):
    found = log_talk(page.read_text())
    assert not found, f"{page.name}:\n" + "\n".join(found)


def test_log_talk_is_found():
    """The check can fail: each kind of log talk in a made-up page is found."""
    text = (
        "Fixed in 85ed7a3.\nThis session measured it on this machine.\n"
        "An earlier run gave 3 s, not explained yet.\n"
    )
    kinds = {line.split(": ", 1)[1].split(" (")[0] for line in log_talk(text)}
    assert kinds == {
        "a commit hash",
        "a session",
        "our machine",
        "a log of runs",
        "an unexplained guess",
    }
    assert log_talk("67108864 bytes, 2026-12-02, jax 0.10.2, sr.json\n") == []
    assert log_talk("git archive d58ce44:benchmarks | tar -x -C old\n") == []


def test_every_page_is_in_the_index():
    index = (DOCS / "index.rst").read_text()
    listed = set(re.findall(r"^   ([\w-]+)$", index, re.M))
    pages = {p.stem for p in DOCS.glob("*.rst")} - {"index"}
    assert pages <= listed, f"not in docs/index.rst's toctree: {sorted(pages - listed)}"


# A reference page is read, not scrolled: past this, split it by question.
PAGE_MAX_LINES = 600


def test_no_page_is_over_600_lines():
    long = {
        p.name: n
        for p in sorted(DOCS.glob("*.rst"))
        if (n := len(p.read_text().splitlines())) > PAGE_MAX_LINES
    }
    assert not long, f"pages over {PAGE_MAX_LINES} lines: {long}"


def test_every_recorded_result_is_cited():
    """docs/benchmarks holds only the JSON a page cites (Sphinx fails on a cited
    file that is missing)."""
    pages = "".join(p.read_text() for p in DOCS.glob("*.rst"))
    results = sorted(p.name for p in (DOCS / "benchmarks").glob("*.json"))
    assert results, "no JSON in docs/benchmarks"
    uncited = [name for name in results if f"benchmarks/{name}`" not in pages]
    assert not uncited, f"in docs/benchmarks, cited by no page: {uncited}"


def _environment_names(module_path) -> set[str]:
    """The environment variables a module names in its module-level constants."""
    tree = ast.parse(module_path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and all(
            isinstance(t, ast.Name) and t.id.isupper() for t in node.targets
        ):
            for const in ast.walk(node.value):
                if isinstance(const, ast.Constant) and isinstance(const.value, str):
                    value = const.value
                    if value != "mpi4jax_dist" and re.fullmatch(
                        r"[A-Za-z][A-Za-z0-9]*_[A-Za-z0-9_]+", value
                    ):
                        names.add(value)
    return names


CONFIGURATION = DOCS / "configuration.rst"


def _table_rows() -> list[list[str]]:
    """The rows of docs/configuration.rst's list-tables, header rows left out:
    each a list of its cells' text."""
    rows, row = [], None
    for line in CONFIGURATION.read_text().splitlines():
        if line.startswith("   * - "):
            row = [line[len("   * - ") :]]
            rows.append(row)
        elif line.startswith("     - ") and row is not None:
            row.append(line[len("     - ") :])
        elif line.strip():
            row = None
    return [r for r in rows if r[0] != "variable"]


def _documented() -> set[str]:
    return {name for row in _table_rows() for name in re.findall(r"``(\w+)``", row[0])}


def test_every_variable_is_in_the_table():
    """Every variable _config/ (and conf/, the build) names is a row of a table
    of docs/configuration.rst."""
    documented = _documented()
    named = set()
    for path in sorted((util.ROOT / "mpi4jax_dist" / "_config").glob("*.py")):
        named |= _environment_names(path)
    # Not variables: PROXY_SETTINGS lists what counts as a proxy setting.
    named -= {"all_proxy", "ftp_proxy", "no_proxy", "no_grpc_proxy"}
    for name in ("mpiconfig", "cudaconfig"):  # where the build reads the environment
        named |= _environment_names(util.ROOT / "conf" / f"{name}.py")
    assert {"MPI4PY_BUILD_MPICC", "MPI4JAX_DIST_BUILD_CUDA"} <= named, named
    missing = sorted(named - documented)
    assert not missing, f"not in docs/configuration.rst: {missing}"


def test_every_package_variable_read_anywhere_is_in_the_table():
    """A variable spelled out anywhere in the package (not through _config) is
    still in the table."""
    documented = _documented()
    spelled = set()
    for path in (util.ROOT / "mpi4jax_dist").rglob("*.py"):
        spelled |= set(re.findall(r"\bMPI4JAX_DIST_[A-Z_]+[A-Z]\b", path.read_text()))
    missing = sorted(spelled - documented)
    assert not missing, f"not in docs/configuration.rst: {missing}"


def test_table_rows_are_complete():
    rows = _table_rows()
    assert len(rows) > 20, rows
    for row in rows:
        assert len(row) == 3 and all(cell.strip() for cell in row), row
        assert re.fullmatch(r"``\w+``(, ``\w+``)*", row[0]), row
