"""``python -m gpuflow demo`` runs the main job; ``python -m gpuflow bench`` the benchmarks;
``python -m gpuflow info`` prints what a bug report needs (versions, driver, devices)."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        print("usage: python -m gpuflow {demo,bench,info} [options]")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        from ._demo import main as demo

        return demo(rest)
    if cmd == "bench":
        from ._bench import main as bench

        return bench(rest)
    if cmd == "info":
        from ._info import main as info

        return info(rest)
    print(f"unknown command {cmd!r}: expected 'demo', 'bench' or 'info'", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
