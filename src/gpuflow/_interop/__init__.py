"""Interop: other libraries' arrays, streams and code.

``from_dlpack`` (their arrays in, without copies), ``wait_stream`` (their
streams, awaited) and ``foreign`` (their code, enqueued on gpuflow's stream,
with stream adapters).  Builds on :mod:`gpuflow._core` and :mod:`gpuflow._memory`.
"""

from ._libraries import ImportedAllocation as ImportedAllocation
from ._libraries import StreamAdapter as StreamAdapter
from ._libraries import foreign as foreign
from ._libraries import from_dlpack as from_dlpack
from ._libraries import register_stream_adapter as register_stream_adapter
from ._libraries import wait_stream as wait_stream

__all__ = [
    "ImportedAllocation",
    "StreamAdapter",
    "foreign",
    "from_dlpack",
    "register_stream_adapter",
    "wait_stream",
]
