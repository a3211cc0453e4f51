"""Sphinx configuration of gpuflow's documentation.

Build it from the repository root:

    python -m pip install -e '.[docs]'
    python -m sphinx -W -b html docs docs/_build/html

``-W`` makes every warning an error: a docstring that does not render, a
page outside the table of contents, a link to a section that is not there.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

# the checkout's sources, whether or not gpuflow is installed
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import gpuflow

project = "gpuflow"
release = gpuflow.__version__
version = release

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "myst_parser"]
# docstrings' Parameters / Returns / Raises sections, NumPy style
napoleon_google_docstring = False
napoleon_numpy_docstring = True
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
root_doc = "index"

# Markdown pages (MyST): headings up to ### get anchors that links may name
myst_heading_anchors = 3

# the API reference (docs/reference/): names as a user imports them
autodoc_member_order = "bysource"
autodoc_preserve_defaults = True  # `dtype=np.float64`, not `<class 'numpy.float64'>`
autodoc_typehints = "signature"
add_module_names = True
# a reference to a name outside gpuflow (NumPy, AnyIO, a private helper)
# renders as code, not as a warning
nitpicky = False

html_theme = "alabaster"
html_title = f"gpuflow {release}"
html_theme_options = {
    "description": "GPU work as a first-class citizen of structured concurrency",
    "fixed_sidebar": True,
}

#: Classes gpuflow makes and hands out, never constructed by a program: their
#: constructor's parameters are private objects, so the reference shows the
#: class without a signature.
MADE_BY_GPUFLOW = {
    "gpuflow.DeviceOperation", "gpuflow.SharedOperation", "gpuflow.Graph",
    "gpuflow.DeviceArray", "gpuflow.Module", "gpuflow.Kernel", "gpuflow.Stream",
    "gpuflow.ExecutionContext", "gpuflow.SchedulingPolicy", "gpuflow.StreamLease",
    "gpuflow.DeviceGroup", "gpuflow.StartedRun", "gpuflow.Communicator", "gpuflow.lowlevel.Run",
    "gpuflow.lowlevel.ImportedAllocation",
}


def _signature(
    app: Any, what: str, name: str, obj: Any, options: Any, signature: str | None,
    return_annotation: str | None,
) -> tuple[str, str | None] | None:
    if what == "class" and name in MADE_BY_GPUFLOW:
        return "", None
    return None


def _skip_member(app: Any, what: str, name: str, obj: Any, skip: bool, options: Any) -> bool | None:
    # a NamedTuple's fields: the class's own docstring describes them
    if (getattr(obj, "__doc__", None) or "").startswith("Alias for field number"):
        return True
    return None


def setup(app: Any) -> None:
    app.connect("autodoc-process-signature", _signature)
    app.connect("autodoc-skip-member", _skip_member)
