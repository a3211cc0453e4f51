"""Graphviz DOT pictures of composed operations.

Nodes are the operations of the recipe (kernels, copies, allocations,
joins, shared and unzip points, host-side steps); an edge goes from an
operation to the one that consumes its output or runs after it.  A shared
source appears once, however many clones use it, so the fan-out is visible.
``then`` functions are opaque until run: their node stands for what they
will build.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._operation import DeviceOperation

_STYLE = {
    "kernel": 'shape=box style="rounded,filled" fillcolor="#cfe2ff"',
    "copy": 'shape=box style=filled fillcolor="#d1e7dd"',
    "alloc": 'shape=box style=filled fillcolor="#fff3cd"',
    "join": 'shape=invtriangle style=filled fillcolor="#e2e3e5"',
    "shared": 'shape=doublecircle style=filled fillcolor="#f8d7da"',
    "then": "shape=cds",
    "map": "shape=note",
    "op": "shape=ellipse",
}


def _quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_dot(op: DeviceOperation[object]) -> str:
    """The DOT text of ``op``'s DAG."""
    ids: dict[int, str] = {}
    lines = ["digraph gpuflow {", "  rankdir=TB;", '  node [fontname="Helvetica"];']

    def visit(node: DeviceOperation[object]) -> str:
        key = node._dot_key()
        if key in ids:
            return ids[key]
        name = f"n{len(ids)}"
        ids[key] = name
        style = _STYLE.get(node._kind(), _STYLE["op"])
        lines.append(f"  {name} [label={_quote(node.label())} {style}];")
        for child in node._children():
            lines.append(f"  {visit(child)} -> {name};")
        return name

    visit(op)
    lines.append("}")
    return "\n".join(lines) + "\n"
