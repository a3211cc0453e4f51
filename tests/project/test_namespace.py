"""The public namespaces present themselves as what a user imports.

``gpuflow``, ``gpuflow.lowlevel`` and ``gpuflow.testing`` re-export names
that private modules define; each lists them in ``__all__``, and each name
reads as ``gpuflow.Name`` (or ``gpuflow.lowlevel.Name``, ...) in tracebacks,
reprs, ``help()`` and pickles, as Trio's names do.
"""

from __future__ import annotations

import ast
import pickle
import pydoc
import subprocess
import sys
import types
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
        is_class = isinstance(getattr(gf, name), type)
        assert (f"    class {name}(" if is_class else f"\n    {name}(") in text, name
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
