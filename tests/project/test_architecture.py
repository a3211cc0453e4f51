"""The package's import structure: layers, not cycles.

Every module of ``gpuflow`` imports what it builds on at its top, and nothing
it builds on imports it back: the front end depends on the backends, never
the reverse, and shared state lives in leaf modules.  These tests read the
source (no import side effects) and fail on a cycle, on an import of a
gpuflow module inside a function, and on an import below other code.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import subprocess
import sys
import typing
from pathlib import Path

import pytest

import gpuflow

PACKAGE = Path(gpuflow.__file__).parent

#: Imports of gpuflow modules inside functions, each with its reason.  An
#: entry here is never a way around a cycle: the cycle test ignores none.
LAZY = {
    # cuda-bindings is loaded only when the cuda backend is asked for (sim
    # programs and CI never pay for it)
    ("gpuflow._backends", "gpuflow._backends._cuda"),
    # `python -m gpuflow CMD` loads only the command it runs
    ("gpuflow.__main__", "*"),
}

pytestmark = pytest.mark.sim_only  # a property of the source, the same on every backend


def _modules() -> dict[str, Path]:
    mods = {}
    for f in PACKAGE.rglob("*.py"):
        parts = list(f.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = f
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Imports(ast.NodeVisitor):
    """The gpuflow modules a module imports: (target, inside a function, line)."""

    def __init__(self, name: str, is_package: bool, mods: dict[str, Path]) -> None:
        self.name, self.is_package, self.mods = name, is_package, mods
        self.found: list[tuple[str, bool, int]] = []
        self._depth = 0

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):  # annotations only: nothing runs
            for n in node.orelse:
                self.visit(n)
            return
        self.generic_visit(node)

    def _function(self, node: ast.AST) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def _add(self, target: str, line: int) -> None:
        while target not in self.mods and "." in target:
            target = target.rsplit(".", 1)[0]
        if target in self.mods and target != self.name:
            self.found.append((target, self._depth > 0, line))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.startswith("gpuflow"):
                self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.name.split(".")
            if not self.is_package:
                base.pop()
            base = base[: len(base) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        if not module.startswith("gpuflow"):
            return
        for alias in node.names:
            sub = f"{module}.{alias.name}"
            self._add(sub if sub in self.mods else module, node.lineno)


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    mods = _modules()
    edges: dict[str, set[str]] = {}
    lazy: list[str] = []
    for name, path in mods.items():
        v = _Imports(name, path.name == "__init__.py", mods)
        v.visit(ast.parse(path.read_text(), str(path)))
        edges[name] = {t for t, _, _ in v.found}
        lazy += [
            f"{path.name}:{line} imports {t} inside a function"
            for t, inner, line in v.found
            if inner and (name, t) not in LAZY and (name, "*") not in LAZY
        ]
    return edges, lazy


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                return [*path[path.index(t):], t]
            if t not in state and (found := visit(t)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_package_has_no_import_cycle() -> None:
    edges, _ = _graph()
    assert len(edges) > 20, "the package was not found"
    cycle = _cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_check_finds_a_cycle() -> None:
    # the checker itself: a planted cycle is reported, with its path
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle(edges) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_imports_gpuflow_inside_a_function() -> None:
    _, lazy = _graph()
    assert lazy == []


def test_every_import_is_at_the_top_of_its_module() -> None:
    late = []
    for name, path in _modules().items():
        body = ast.parse(path.read_text()).body
        seen_code = False
        for node in body:
            is_import = isinstance(node, ast.Import | ast.ImportFrom) or (
                isinstance(node, ast.If) and _is_type_checking(node.test)
            )
            docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            if is_import and seen_code:
                late.append(f"{name}:{node.lineno}")
            elif not is_import and not docstring:
                seen_code = True
    assert late == []


#: A module tells one story: past this many lines it is two.
MAX_MODULE_LINES = 1000


def test_no_module_grows_past_a_thousand_lines() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert len(sizes) > 20, "the package was not found"
    too_long = {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}
    assert too_long == {}


#: ``Any`` per 1,000 lines of ``src/`` at most: a value's type says what it
#: is, ``object`` where anything goes, and ``Any`` only where another
#: library's untyped objects (a loop's internals, NCCL's bindings) are read.
MAX_ANY_PER_1000_LINES = 12


def _any_count(text: str) -> int:
    """How many times a module's code (not its docstrings) names ``Any``."""
    return sum(
        1
        for node in ast.walk(ast.parse(text))
        if (isinstance(node, ast.Name) and node.id == "Any")
        or (isinstance(node, ast.Attribute) and node.attr == "Any")
    )


def test_src_names_any_sparingly() -> None:
    texts = [path.read_text() for path in _modules().values()]
    lines = sum(len(t.splitlines()) for t in texts)
    anys = sum(_any_count(t) for t in texts)
    assert lines > 10_000, "the package was not found"
    assert anys * 1000 / lines <= MAX_ANY_PER_1000_LINES, (anys, lines)
    # the count sees annotations and casts, never prose
    assert _any_count('"""Any thread."""\nx: Any = cast(typing.Any, 1)\n') == 2


def test_the_backend_interface_takes_its_handles_typed() -> None:
    # a raw handle has its own type in every method of the interface: no
    # stream where an event is wanted, no Any for either
    from gpuflow._backends import _base, _comms

    for module in (_base, _comms):
        source = inspect.getsource(module)
        tree = ast.parse(source)
        untyped = [
            f"{module.__name__}:{fn.name}"
            for fn in ast.walk(tree)
            if isinstance(fn, ast.FunctionDef)
            and any(
                "Any" in ast.unparse(a)
                for a in [*(x.annotation for x in fn.args.args if x.annotation), fn.returns]
                if a is not None
            )
        ]
        assert untyped == []
    ll = gpuflow.lowlevel
    hints = typing.get_type_hints(ll.Backend.wait_event)
    assert hints["stream"] is ll.RawStream and hints["event"] is ll.RawEvent
    assert typing.get_type_hints(ll.Backend.create_stream)["return"] is ll.RawStream


def test_no_test_file_grows_past_a_thousand_lines() -> None:
    # the tests mirror the package, one folder a layer: a file past this
    # tells two stories as a module of src/ would
    tests = Path(__file__).parents[1]
    files = list(tests.rglob("*.py"))  # (the mutation check's files too)
    sizes = {str(f.relative_to(tests)): len(f.read_text().splitlines()) for f in files}
    assert len(sizes) > 30, "the tests were not found"
    assert {f: n for f, n in sizes.items() if n > MAX_MODULE_LINES} == {}


def test_every_planted_bug_of_the_mutation_check_still_finds_its_code() -> None:
    """``tests/mutations/mutate.py`` plants each bug by an exact text
    replacement, and refuses one whose code moved: a change of the code
    under a mutation must move the mutation with it, here rather than at
    the next (long) mutation run."""
    import importlib.util

    path = Path(__file__).parents[1] / "mutations" / "mutate.py"
    spec = importlib.util.spec_from_file_location("gpuflow_mutations", path)
    assert spec is not None and spec.loader is not None
    mutations = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mutations  # (its dataclasses look their module up)
    try:
        spec.loader.exec_module(mutations)
    finally:
        del sys.modules[spec.name]
    src = Path(gpuflow.__file__).parent
    found = {m.name: (src / m.path).read_text().count(m.old) for m in mutations.MUTATIONS}
    assert len(found) > 60 and len(found) == len(mutations.MUTATIONS)  # (names are unique)
    assert {name: n for name, n in found.items() if n != 1} == {}
    # and the tests each runs are there: a path that moved would make pytest
    # fail to collect, which the script counts as the mutation caught
    root = Path(__file__).parents[2]
    missing = []
    for m in mutations.MUTATIONS:
        for test in m.tests:
            path, _, name = test.partition("::")
            if not (root / path).is_file():
                missing.append(f"{m.name}: {path}")
            elif name and f"def {name}(" not in (root / path).read_text():
                missing.append(f"{m.name}: {test}")
    assert missing == []


def test_import_gpuflow_runs_each_module_once_top_to_bottom() -> None:
    # at run time: no import statement of any gpuflow module may reach a
    # module that is still being executed (what a cycle does), and each
    # module is executed once
    code = r"""
import builtins, importlib.util, sys
problems, executed = [], []
real_import = builtins.__import__
def watch(name, globals=None, locals=None, fromlist=(), level=0):
    package = (globals or {}).get("__package__") or ""
    target = importlib.util.resolve_name("." * level + name, package) if level else name
    if target.startswith("gpuflow"):
        names = [target + "." + f for f in fromlist or ()] if fromlist else [target]
        for n in names:
            m = sys.modules.get(n)
            spec = getattr(m, "__spec__", None)
            if spec is not None and getattr(spec, "_initializing", False):
                problems.append(f"{globals.get('__name__')} imports {n} before it finished")
    return real_import(name, globals, locals, fromlist, level)
builtins.__import__ = watch
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name.startswith("gpuflow"):
            if name in executed:
                problems.append("executed twice: " + name)
            executed.append(name)
        return None
sys.meta_path.insert(0, Watch())
import gpuflow, gpuflow.testing, gpuflow.lowlevel
print(len(executed), problems)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    count, problems = out.stdout.split(" ", 1)
    assert int(count) > 15, out.stdout  # the watch saw the package being imported
    assert problems.strip() == "[]", problems


#: The folders from the bottom up: a module imports only from its own folder
#: and the folders below it.  ``""`` is the package's top: the public
#: namespaces (``gpuflow``, ``lowlevel``, ``testing``) and ``__main__``.
LAYERS = ["_errors", "_backends", "_core", "_memory", "_kernels", "_scopes", "_interop",
          "_comm", "_testing", "_tools", ""]  # fmt: skip

#: The public modules, all that the commands of ``_tools`` may import.
PUBLIC = {"gpuflow", "gpuflow.lowlevel", "gpuflow.testing"}



def _folder(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("lowlevel", "testing", "__main__"):
        return ""
    return parts[1]


def _imports_of(name: str, path: Path) -> list[tuple[str, list[str], int]]:
    """Every gpuflow import of a module, type-only ones and those inside
    functions included: (the module imported from, the names, line)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                if path.name != "__init__.py":
                    base.pop()
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] == "gpuflow":
                found.append((module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names if a.name.startswith("gpuflow")]
    return found


def _offered(package: str, mods: dict[str, Path]) -> set[str]:
    """The names a folder's ``__init__`` lists in ``__all__``."""
    for node in ast.parse(mods[package].read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return {e.value for e in node.value.elts}  # type: ignore[attr-defined]
    return set()


def _layer_problems() -> list[str]:
    mods = _modules()
    problems = []
    for name, path in sorted(mods.items()):
        mine = _folder(name)
        for module, names, line in _imports_of(name, path):
            where = f"{name}:{line}"
            theirs = _folder(module)
            if theirs == mine:
                continue
            if mine == "_tools":
                if module in PUBLIC:
                    continue
                problems.append(f"{where}: a command imports {module}, not a public namespace")
                continue
            if name == "gpuflow.__main__" and theirs == "_tools":
                continue  # (a command's module, loaded only when it runs)
            if LAYERS.index(theirs) > LAYERS.index(mine):
                problems.append(f"{where}: {mine or 'the top'} imports {module}, a layer above it")
                continue
            package = f"gpuflow.{theirs}"
            if theirs == "_errors":  # (a module: the exception hierarchy)
                continue
            if module != package:
                problems.append(f"{where}: imports the module {module}, not {package}'s names")
                continue
            missing = set(names) - _offered(package, mods)
            if missing:
                problems.append(f"{where}: {package}'s __all__ does not offer {sorted(missing)}")
    return problems


def test_a_folder_imports_only_names_the_folders_below_it_offer() -> None:
    assert len(_modules()) > 40, "the package was not found"
    assert _layer_problems() == []


def _unused_offers(package: str) -> set[str]:
    """The names ``package``'s ``__init__`` offers that no module of another
    folder imports (nor reads as an attribute of the package)."""
    mods = _modules()
    mine = _folder(package)
    used: set[str] = set()
    for name, path in mods.items():
        if _folder(name) == mine:
            continue
        for module, names, _line in _imports_of(name, path):
            if module == package:
                used.update(names)
        tail = package.rsplit(".", 1)[1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == tail
            ):
                used.add(node.attr)
    return _offered(package, mods) - used


def test_the_core_offers_only_what_a_folder_above_it_uses() -> None:
    """``_core/__init__`` is the core's interface to the folders above it:
    a name none of them uses is the core's own, imported from its module
    where the core (or a test) needs it."""
    assert _unused_offers("gpuflow._core") == set()


#: What a suspension of an event loop's own looks like, spelled directly
_LOOP_PRIMITIVES = ("anyio.", "asyncio.", "trio.", "sniffio.")


def _suspensions_outside_the_loop_module(sources: dict[str, str]) -> list[str]:
    """Each ``await`` or ``yield from`` in ``sources`` (module name: text)
    of an event loop's own primitive (anyio's, asyncio's, Trio's, or an
    event's ``wait()``), rather than of the loop module's."""
    found = []
    for name, text in sorted(sources.items()):
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.Await, ast.YieldFrom)):
                continue
            target = node.value
            if (
                isinstance(target, ast.Call)
                and isinstance(target.func, ast.Attribute)
                and target.func.attr == "__await__"
            ):
                target = target.func.value
            spelled = ast.unparse(target)
            called = spelled.split("(", 1)[0]
            if called.startswith(_LOOP_PRIMITIVES) or called.endswith(".wait"):
                found.append(f"{name}:{node.lineno}: {spelled}")
    return found


def test_only_the_loop_module_suspends_a_task_of_the_core() -> None:
    """Every suspension of a task in ``_core`` is one the loop module
    offers (a park, a checkpoint, ``wait_event``): one module says where a
    task may suspend, as Trio's ``_traps``."""
    sources = {
        name: path.read_text()
        for name, path in _modules().items()
        if name.startswith("gpuflow._core.") and name != "gpuflow._core._loops"
    }
    assert len(sources) > 10
    assert _suspensions_outside_the_loop_module(sources) == []


def test_the_suspension_check_finds_a_loops_own_primitive() -> None:
    planted = {
        "m": "async def f(e):\n    await anyio.sleep(0)\n    await e.wait()\n"
        "def g(loop):\n    yield from anyio.lowlevel.checkpoint().__await__()\n"
        "    yield from loop.checkpoint().__await__()\n"
    }
    assert _suspensions_outside_the_loop_module(planted) == [
        "m:2: anyio.sleep(0)", "m:3: e.wait()", "m:5: anyio.lowlevel.checkpoint()",
    ]


def test_the_layer_check_finds_an_import_from_above_and_one_past_a_folders_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the checker itself, on a planted package: an import of a layer above,
    # one of a folder's module rather than its names, one of a name its
    # __init__ does not offer
    pkg = tmp_path / "gpuflow"
    for folder, init in {"_core": '__all__ = ["run"]\nfrom ._run import run\n',
                         "_memory": '__all__ = ["array"]\n'}.items():  # fmt: skip
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text(init)
    (pkg / "__init__.py").write_text("")
    (pkg / "_core" / "_run.py").write_text("from .._memory import array\n")
    (pkg / "_memory" / "_array.py").write_text(
        "from .._core._run import run\nfrom .._core import hidden\nfrom .._core import run\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    assert _layer_problems() == [
        "gpuflow._core._run:1: _core imports gpuflow._memory, a layer above it",
        "gpuflow._memory._array:1: imports the module gpuflow._core._run, "
        "not gpuflow._core's names",
        "gpuflow._memory._array:2: gpuflow._core's __all__ does not offer ['hidden']",
    ]


def test_no_module_imports_another_modules_underscore_names() -> None:
    # a module's own underscore names are its own; modules (``from . import
    # _run``) are imported by their names
    mods = _modules()
    found = [
        f"{name}:{line} imports {n} from {module}"
        for name, path in mods.items()
        for module, names, line in _imports_of(name, path)
        for n in names
        if n.startswith("_") and not n.startswith("__") and f"{module}.{n}" not in mods
    ]
    assert found == []


#: Underscore attributes of objects that are not gpuflow's, read where no
#: public way gives the same (each module's own, with why).
FOREIGN_PRIVATE = {
    # the loop fast paths, in one place: AnyIO's record of a task's cancel
    # scopes and Trio's of a task's runner and cancel status, asked without
    # a coroutine (tests/core/test_loops.py pins each to the versions installed)
    "gpuflow._core._loops": {
        "_task_states", "_cancel_called", "_shield", "_parent_scope", "_cancel_status",
        "_runner", "_get_running_loop", "_thread_id",
    },
    # the caller's frame, for the line a failure names
    "gpuflow._testing._cancel_at_every_point": {"_getframe"},
    # a named tuple's own method (public, despite its underscore)
    "gpuflow._backends._cuda._timing": {"_replace"},
    # nccl4py's communicator gives its bindings' handle object only so
    "gpuflow._backends._cuda._nccl": {"_comm"},
    "gpuflow._tools._bench_comm": {"_comm"},
}  # fmt: skip


#: What public classes share with gpuflow's own layers, by class: not the
#: user's, so each name starts with an underscore and stays out of the
#: public surface (``tests/project/test_namespace.py`` pins that surface),
#: and the package's modules read them by these names alone.
LAYER_HOOKS: dict[tuple[str, str], set[str]] = {
    # what a run, the picture and the trace ask an operation
    ("gpuflow._core._operation", "DeviceOperation"): {
        "_plan", "_children", "_kind", "_dot_key", "_output_dtype",
    },
    # a stream's runtime, its context's generation, completion lane, the
    # event a destroyed one leaves, its count of blocking runs
    ("gpuflow._core._stream", "Stream"): {
        "_runtime", "_generation", "_lane", "_final", "_begin_blocking",
        "_end_blocking",
    },
    ("gpuflow._core._execution", "ExecutionContext"): {"_runtime"},
    # what a run asks of the scopes it starts in (a lease pins its stream)
    ("gpuflow._core._scoped", "Scope"): {"_track", "_pinned"},
    # the runs a collective's communicators may fail; what gf.in_flight()
    # reads of a run (what it runs, since when, who waits, what it waits for)
    ("gpuflow._core._run", "Run"): {"_comms", "_what", "_since", "_task", "_waits", "_number"},
    ("gpuflow._memory._array", "DeviceArray"): {"_allocation", "_check_usable"},
    ("gpuflow._comm._communicator", "Communicator"): {"_failure"},
}  # fmt: skip


_HOOK_NAMES = set().union(*LAYER_HOOKS.values())


def test_each_layer_hook_is_its_classs_own() -> None:
    for (module, cls), names in LAYER_HOOKS.items():
        owner = getattr(importlib.import_module(module), cls)
        own = set(dir(owner)) | {
            n for c in owner.__mro__ for n in getattr(c, "__slots__", ())
        } | set(getattr(owner, "__annotations__", {}))
        assert names - own == set(), (cls, names - own)


def _attribute_problems() -> list[str]:
    """Reads of an underscore attribute that no class of the reading module
    defines, other than on ``self`` or ``cls``: another module's private state."""
    problems = []
    for name, path in sorted(_modules().items()):
        tree = ast.parse(path.read_text(), str(path))
        own: set[str] = set()
        for n in ast.walk(tree):
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                own.add(n.name)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                own.add(n.attr)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                own.add(n.id)
            elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                own.add(n.target.id)
            elif isinstance(n, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__slots__" for t in n.targets
            ):
                own |= {c.value for c in ast.walk(n.value) if isinstance(c, ast.Constant)}
        allowed = own | FOREIGN_PRIVATE.get(name, set()) | _HOOK_NAMES
        for n in ast.walk(tree):
            if (
                isinstance(n, ast.Attribute)
                and n.attr.startswith("_")
                and not n.attr.startswith("__")
                and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))
                and n.attr not in allowed
            ):
                problems.append(f"{name}:{n.lineno} reads {ast.unparse(n.value)}.{n.attr}")
    return problems


def test_no_module_reads_another_modules_underscore_attributes() -> None:
    assert len(_modules()) > 40, "the package was not found"
    assert _attribute_problems() == []


def test_the_attribute_check_finds_a_read_of_another_modules_private_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg = tmp_path / "gpuflow"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_a.py").write_text("class A:\n    def __init__(self):\n        self._x = 1\n")
    (pkg / "_b.py").write_text(
        "def f(a, b):\n    return a._x + b._y\n"
        "class B:\n    __slots__ = ('_y',)\n    def g(self, other):\n        return self._z\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    # a._x is A's (another module's); b._y is B's own; self._z is self's
    assert _attribute_problems() == ["gpuflow._b:2 reads a._x"]
