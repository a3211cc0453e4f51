"""python -m gpuflow COMMAND [options]

commands:
  demo   the main job: a 22-layer, 132-kernel token loop run three ways (a
         sync after every kernel, one awaited chain a token, a graph replay),
         then fanned out over every device
  bench  the benchmarks: each measurement beside a baseline measured in the
         same run, their ratio and the target
  info   what a bug report needs: gpuflow's, Python's and the packages'
         versions, the CUDA driver, the devices, the backend gpuflow picks

"python -m gpuflow COMMAND --help" tells more of one.  Without a GPU, demo
and bench run on sim, gpuflow's simulation of a CUDA device, and say so.
"""

from __future__ import annotations

import sys

COMMANDS = ("demo", "bench", "info")


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        # the docstring is the help: plain text, as a terminal shows it
        print("usage: " + (__doc__ or "").strip(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        from ._tools._demo import main as demo

        return demo(rest)
    if cmd == "bench":
        from ._tools._bench import main as bench

        return bench(rest)
    if cmd == "info":
        from ._tools._info import main as info

        return info(rest)
    print(f"unknown command {cmd!r}: expected one of {', '.join(COMMANDS)} "
          "(python -m gpuflow --help)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
