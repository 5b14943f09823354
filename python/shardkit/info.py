"""``python -m shardkit.info``: what this build of shardkit was made against (torch, CUDA,
the architectures compiled, CPU-only or CUDA and why) and whether the GPUs visible now can
run it. Exits 1 when something will not work (each problem is printed with its fix)."""

import sys

from shardkit.build import build_info, format_info


def main() -> int:
    info = build_info()
    print(format_info(info))
    return 1 if info["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
