"""The commands of ``python -m gpuflow``: ``demo``, ``bench`` and ``info``.

Each is loaded only when it runs; they use the public namespaces
(:mod:`gpuflow`, :mod:`gpuflow.lowlevel`, :mod:`gpuflow.testing`) and
nothing of the layers below.
"""

