"""The public namespaces present themselves as what a user imports.

``gpuflow``, ``gpuflow.lowlevel`` and ``gpuflow.testing`` re-export names
that private modules define; each lists them in ``__all__``, and each name
reads as ``gpuflow.Name`` (or ``gpuflow.lowlevel.Name``, ...) in tracebacks,
reprs, ``help()`` and pickles, as Trio's names do.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pickle
import pydoc
import re
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest
from helpers import kernels as K

import gpuflow as gf
from gpuflow import lowlevel, testing

pytestmark = pytest.mark.sim_only  # properties of the package, the same on every backend

NAMESPACES = [gf, lowlevel, testing]


def _public(ns: types.ModuleType) -> set[str]:
    """What a namespace offers, by the package's convention: what it re-exports
    (``from ._x import Name as Name``) and the functions it defines itself."""
    tree = ast.parse(Path(ns.__file__ or "").read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level:
            names |= {a.name for a in node.names if a.asname == a.name}
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
    return {n for n in names if not n.startswith("_")} - {"lowlevel", "testing"}


@pytest.mark.parametrize("ns", NAMESPACES, ids=lambda ns: ns.__name__)
def test_all_lists_exactly_what_the_namespace_offers(ns: types.ModuleType) -> None:
    assert len(ns.__all__) == len(set(ns.__all__)), "a name is listed twice"
    assert [n for n in ns.__all__ if not hasattr(ns, n)] == []
    assert set(ns.__all__) == _public(ns)


@pytest.mark.parametrize("ns", NAMESPACES, ids=lambda ns: ns.__name__)
def test_public_names_say_the_public_module(ns: types.ModuleType) -> None:
    wrong = {}
    for name in ns.__all__:
        obj = getattr(ns, name)
        module = getattr(obj, "__module__", None)
        if module is not None and module.startswith("gpuflow") and not (
            module == ns.__name__ or (ns is not gf and module == "gpuflow")
        ):
            wrong[name] = module
    assert wrong == {}
    # a name both the package and a submodule offer is the package's
    assert lowlevel.ExecutionContext.__module__ == "gpuflow"
    # methods too: help() and inspect see them
    assert gf.DeviceOperation.then.__module__ == "gpuflow"


def test_help_lists_the_api() -> None:
    text = pydoc.plain(pydoc.render_doc(gf))
    for name in gf.__all__:
        obj = getattr(gf, name)
        if isinstance(obj, type):
            assert f"    class {name}(" in text, name
        else:
            shown = f"\n    async {name}(" if inspect.iscoroutinefunction(obj) else f"\n    {name}("
            assert shown in text, name
    # the docstring's overview names every public name, by topic
    doc = gf.__doc__ or ""
    assert [n for n in gf.__all__ if n not in doc] == []
    lowlevel_text = pydoc.plain(pydoc.render_doc(lowlevel))
    assert "current_backend_object(" in lowlevel_text and "class Run" in lowlevel_text


def test_a_traceback_names_the_public_error() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "import gpuflow as gf; gf.zeros(-1)"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("gpuflow.UsageError: shape (-1,) has a negative dimension"), last


def test_reprs_say_gpuflow() -> None:
    mod = K.module()
    assert repr(mod).startswith("<gpuflow.Module kernels: saxpy, vadd, ")
    assert repr(mod.saxpy).startswith("<gpuflow.Kernel saxpy(")
    x = gf.zeros(3).sync()
    seen = gf.with_context(lambda ctx: gf.value(repr(ctx))).sync()
    for r in (repr(x), repr(gf.value(1)), repr(gf.new_stream()), seen,
              repr(gf.open_stream_lease()), repr(gf.open_device_group())):
        assert r.startswith("<gpuflow."), r
    assert repr(gf.UsageError("x")) == "UsageError('x')"  # Python's own form for exceptions


def test_public_objects_pickle_by_their_public_name() -> None:
    err = pickle.loads(pickle.dumps(gf.DeviceFaultError("boom", code=700, device=1)))
    assert type(err) is gf.DeviceFaultError and err.code == 700 and err.device == 1
    info = gf.RankInfo(0, 2, b"id")
    assert pickle.loads(pickle.dumps(info)) == info
    assert b"gpuflow._" not in pickle.dumps(info) + pickle.dumps(gf.LaunchConfig(1, 1))


# -- the public surface is the documented one ----------------------------------------------------

REFERENCE = Path(__file__).parents[2] / "docs" / "reference"
_PAGES = {gf: "gpuflow.rst", lowlevel: "lowlevel.rst", testing: "testing.rst"}
#: what every class has from Python itself (a tuple's count, an exception's args)
_INHERITED = set().union(*(dir(b) for b in (object, tuple, Exception, typing.Generic)))


def _entries(ns: types.ModuleType) -> dict[str, set[str] | None]:
    """What the reference page of ``ns`` documents: each name, with the
    members its entry lists (a class), or None (a function, data, an error)."""
    entries: dict[str, set[str] | None] = {}
    current: str | None = None
    prefix = f"{ns.__name__}."
    for line in (REFERENCE / _PAGES[ns]).read_text().splitlines():
        m = re.match(r"\.\. (auto\w+|py:\w+):: ([\w.]+)", line)
        if m and m[2].startswith(prefix) and not m[2][len(prefix):].startswith("_"):
            current = m[2][len(prefix):]
            entries[current] = set() if m[1] == "autoclass" else None
        elif m:
            current = None
        elif current is not None and line.startswith("   :members:"):
            listed = line.partition(":members:")[2]
            entries[current] = {n.strip() for n in listed.split(",") if n.strip()}
    return entries


def _public_members(cls: type) -> set[str]:
    names = {n for n in dir(cls) if not n.startswith("_")} - _INHERITED
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    return names


@pytest.mark.parametrize("ns", NAMESPACES, ids=lambda ns: ns.__name__)
def test_a_namespace_offers_what_its_reference_page_documents(ns: types.ModuleType) -> None:
    # (pytest's assertion rewriting adds names that are no identifiers)
    offered = {n for n in dir(ns) if n.isidentifier() and not n.startswith("_")}
    offered -= {"lowlevel", "testing"}
    assert offered == set(ns.__all__)  # (no helper a module imported, no `annotations`)
    assert set(_entries(ns)) == set(ns.__all__)


@pytest.mark.parametrize("ns", NAMESPACES, ids=lambda ns: ns.__name__)
def test_each_public_class_offers_what_its_reference_entry_lists(ns: types.ModuleType) -> None:
    wrong = {}
    for name, listed in _entries(ns).items():
        obj = getattr(ns, name)
        if listed is None or not isinstance(obj, type):  # (an error, or an alias of a class)
            continue
        offered = _public_members(obj)
        if listed != offered:
            wrong[name] = {"undocumented": offered - (listed or set()),
                           "documented, not offered": (listed or set()) - offered}
    assert wrong == {}


def test_the_internals_named_by_a_newcomer_are_not_public() -> None:
    op = gf.value(1)
    for name in ("stream_home", "stream_alone", "dot_key", "children", "kind", "ordinary",
                 "direct", "awaited_alone", "has_home", "output_dtype"):
        assert not hasattr(op, name), name
    for name in ("begin_blocking", "end_blocking", "lane", "life", "runtime", "final"):
        assert not hasattr(gf.Stream, name), name
    for name in ("Any", "Callable", "contextlib", "annotations"):
        assert not hasattr(testing, name), name
