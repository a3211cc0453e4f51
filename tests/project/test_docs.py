"""The documentation site (``docs/``) and the README, its front door.

The reference pages must document every public name: a name added to an
``__all__`` without its entry in ``docs/reference/`` fails here, before
Sphinx runs (CI then builds the site with ``-W``, where a docstring that
does not render fails too).  The README stays short and points to the site.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest

import gpuflow as gf
from gpuflow import lowlevel, testing

pytestmark = pytest.mark.sim_only  # properties of the sources, the same on every backend

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
REFERENCE = DOCS / "reference"
README = (ROOT / "README.md").read_text()
NAMESPACES = [gf, lowlevel, testing]

#: A directive that documents a Python object, and the object's full name
#: (``.. autofunction:: gpuflow.zip``, ``.. py:data:: gpuflow.lowlevel.X``)
DIRECTIVE = re.compile(
    r"^\.\. (auto|py:)(class|function|exception|data|decorator)::\s+([\w.]+)", re.M
)


def _documented() -> dict[str, str]:
    """Every object the reference pages document: its full name, and the page."""
    names: dict[str, str] = {}
    for page in sorted(REFERENCE.glob("*.rst")):
        for _, _, name in DIRECTIVE.findall(page.read_text()):
            assert name not in names, f"{name} is documented twice ({names[name]}, {page.name})"
            names[name] = page.name
    return names


@pytest.mark.parametrize("ns", NAMESPACES, ids=lambda ns: ns.__name__)
def test_the_reference_documents_every_public_name(ns: types.ModuleType) -> None:
    documented = _documented()
    page = f"{ns.__name__.rsplit('.', 1)[-1]}.rst"
    missing = [n for n in ns.__all__ if f"{ns.__name__}.{n}" not in documented]
    assert missing == [], f"add these to docs/reference/{page}"
    elsewhere = {n: documented[f"{ns.__name__}.{n}"] for n in ns.__all__}
    assert set(elsewhere.values()) == {page}, elsewhere
    # and each documents itself: autodoc renders the docstring
    assert [n for n in ns.__all__ if not (getattr(ns, n).__doc__ or "").strip()] in (
        [], ["Step", "StreamAdapter"]  # type aliases, described on the page itself
    )


#: The sections of a NumPy-style docstring (rendered by Sphinx's napoleon).
SECTIONS = re.compile(r"^ *(Parameters|Returns|Yields|Raises)\n *-{5,}$", re.M)


@pytest.mark.parametrize("ns", NAMESPACES, ids=lambda ns: ns.__name__)
def test_every_public_function_says_its_parameters_returns_or_raises(
    ns: types.ModuleType,
) -> None:
    # a reader scans the sections, not the prose, for what a call takes,
    # gives back and raises
    functions = [n for n in ns.__all__ if isinstance(getattr(ns, n), types.FunctionType)]
    assert len(functions) > 3
    bare = [n for n in functions if not SECTIONS.search(getattr(ns, n).__doc__ or "")]
    assert bare == []


@pytest.mark.parametrize("ns", NAMESPACES, ids=lambda ns: ns.__name__)
def test_every_public_function_states_its_thread_or_cancellation_guarantee(
    ns: types.ModuleType,
) -> None:
    # which threads may call it, or what a cancellation does to it: one
    # sentence a reader finds without reading the function
    functions = [n for n in ns.__all__ if isinstance(getattr(ns, n), types.FunctionType)]
    silent = [
        n for n in functions
        if not re.search(r"\bthreads?\b|\bcancel", getattr(ns, n).__doc__ or "", re.I)
    ]
    assert silent == []


@pytest.mark.parametrize("ns", NAMESPACES, ids=lambda ns: ns.__name__)
def test_every_public_method_says_its_parameters_returns_or_raises(
    ns: types.ModuleType,
) -> None:
    # of the public classes, every method that takes an argument or gives
    # something back (one with neither has nothing for the sections to say)
    bare = []
    for n in ns.__all__:
        cls = getattr(ns, n)
        if not isinstance(cls, type) or issubclass(cls, BaseException):
            continue
        for name in dir(cls):
            m = inspect.getattr_static(cls, name)
            if isinstance(m, staticmethod | classmethod):
                m = m.__func__
            if name.startswith("_") or not isinstance(m, types.FunctionType):
                continue
            sig = inspect.signature(m)
            if len(sig.parameters) <= 1 and sig.return_annotation in (None, "None"):
                continue
            if not SECTIONS.search(inspect.getdoc(getattr(cls, name)) or ""):
                bare.append(f"{n}.{name}")
    assert bare == []


@pytest.mark.parametrize("ns", NAMESPACES, ids=lambda ns: ns.__name__)
def test_every_public_class_says_how_it_is_made(ns: types.ModuleType) -> None:
    # a class a user constructs says its parameters; one that a factory
    # makes says which (a record's fields are its attributes)
    bare = []
    for n in ns.__all__:
        cls = getattr(ns, n)
        if not isinstance(cls, type) or issubclass(cls, BaseException):
            continue
        if dataclasses.is_dataclass(cls) or hasattr(cls, "_fields"):
            continue
        params = [p for p in inspect.signature(cls).parameters if p not in ("args", "kwargs")]
        doc = inspect.getdoc(cls) or ""
        if params and not (SECTIONS.search(doc) or re.search(r"\b[Mm]ade by\b", doc)):
            bare.append(n)
    assert bare == []


def test_the_reference_documents_only_public_names() -> None:
    public = {f"{ns.__name__}.{n}" for ns in NAMESPACES for n in ns.__all__}
    stale = [n for n in _documented() if n not in public and not n.endswith("__version__")]
    assert stale == [], "documented, but in no __all__"


def test_every_page_is_in_the_table_of_contents() -> None:
    """Sphinx says so too (a warning, an error under ``-W``); this says which."""
    index = (DOCS / "index.md").read_text()
    pages = {p.stem for p in DOCS.glob("*.md") if p.stem != "index"}
    assert [p for p in sorted(pages) if not re.search(rf"^{p}$", index, re.M)] == []
    assert re.search(r"^reference/index$", index, re.M)


def test_ci_builds_the_docs_with_warnings_as_errors() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 -m pip install -q -e '.[docs]'" in ci
    assert "python3 -m sphinx -W -b html docs docs/_build/html" in ci
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert {r.split("=")[0] for r in extras["docs"]} >= {"sphinx", "myst-parser"}
    assert "docs/_build/" in (ROOT / ".gitignore").read_text().splitlines()


# -- the tutorial's programs run as written -------------------------------------------------------

TUTORIAL = (DOCS / "tutorial.md").read_text()
#: The tutorial's complete programs (its Python blocks), and what each prints
PROGRAMS = re.findall(r"^```python\n(.*?)^```", TUTORIAL, re.M | re.S)
PRINTS = [
    ["[1. 3. 5. 7.]"],
    ["[10. 12. 14. 16.]"],
    ["sum 1024,", "cancelled: True", "ok"],
    ["10: 'ok 1024'", "20: 'ok 1024'", "30: 'ok 1024'", "500: 'timeout'"],
    ["no class ", "the classes went first: True"],
]


def test_the_tutorial_is_its_programs() -> None:
    assert len(PROGRAMS) == len(PRINTS)
    assert all("anyio.run(main" in p for p in PROGRAMS)
    # the README's first program is the tutorial's
    assert re.findall(r"^```python\n(.*?)^```", README, re.M | re.S)[0] == PROGRAMS[0]


@pytest.mark.parametrize(
    "index",  # (the last compares times: the classes against none, so it runs alone)
    [*range(len(PRINTS) - 1), pytest.param(len(PRINTS) - 1, marks=pytest.mark.alone)],
)
def test_a_tutorial_program_runs(index: int, tmp_path: Path) -> None:
    """Each program as a user saves and runs it: on ``sim`` where there is no
    GPU, on ``cuda`` where there is one (gpuflow's own choice, as in the
    tutorial)."""
    path = tmp_path / f"program_{index}.py"
    path.write_text(PROGRAMS[index])
    src = str(ROOT / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=100, env=env
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for line in PRINTS[index]:
        assert line in proc.stdout, proc.stdout
# -- the README: the short front door -------------------------------------------------------------


def test_the_readme_lists_every_example() -> None:
    rows = set(re.findall(r"^\| `examples/(\w+\.py)` \|", README, re.M))
    assert rows == {p.name for p in (ROOT / "examples").glob("*.py")}


def test_the_readme_links_resolve() -> None:
    links = re.findall(r"\]\(((?:docs|examples)/[^)#]+)(?:#[^)]*)?\)", README)
    assert links, "the README links to the documentation pages"
    assert [link for link in links if not (ROOT / link).exists()] == []
    # every page of the site is one click away
    linked = {Path(link).name for link in links}
    assert {"tutorial.md", "concepts.md", "performance.md"} <= linked


def test_the_readme_is_a_front_door() -> None:
    """What, install, a first program, links: the measurements and the design
    live on the site, each figure with its command and hardware."""
    assert len(README.splitlines()) < 200
    assert "µs" not in README and "H200" not in README  # no measurements
    for word in ("issue", "target"):  # nothing a user cannot see
        assert not re.search(rf"\b{word}s?\b", README, re.I), word
    assert "python -m sphinx -b html docs docs/_build/html" in README


def test_the_readme_anchors_name_its_headings() -> None:
    """A link to ``#section`` of the README itself names one of its headings
    (GitHub's anchors: lower case, spaces as hyphens, punctuation dropped)."""
    anchors = set(re.findall(r"\]\(#([^)]+)\)", README))
    headings = {
        re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.+)$", README, re.M)
    }
    assert anchors - headings == set()


# -- the testing page's example, pasted into a test file of its own ------------------------------

TESTING = (DOCS / "testing.md").read_text()


def test_the_testing_pages_cancellation_example_runs_as_pasted(tmp_path: Path) -> None:
    """The ledger example of "Cancelling at every point", saved as a test file
    with nothing added, passes under pytest (gpuflow's plugin gives its
    fixture): every name it uses is imported."""
    (block,) = [b for b in re.findall(r"^```python\n(.*?)^```", TESTING, re.M | re.S)
                if "ledger = " in b]
    path = tmp_path / "test_ledger_example.py"
    path.write_text(block)
    src = str(ROOT / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
               GPUFLOW_BACKEND="sim")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)],
        capture_output=True, text=True, timeout=100, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"\b\d+ passed", proc.stdout) and "failed" not in proc.stdout, proc.stdout
