"""``python -m shardkit.info``: what this build of shardkit was made against (torch, CUDA,
the architectures compiled, CPU-only or CUDA and why) and whether the GPUs visible now can
run it. Exits 1 when something will not work (each problem is printed with its fix), 2 with
one line on stderr for an unknown argument (it takes none but --help)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn, Optional, Sequence

from shardkit.build import build_info, format_info


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # the CLI contract: one line on stderr, exit status 2
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Prints the build record; returns 0, or 1 when it lists problems."""
    _Parser(prog="python -m shardkit.info", description=(__doc__ or "").split("\n\n")[0].replace("``", "")).parse_args(
        argv
    )
    info = build_info()
    try:
        print(format_info(info), flush=True)
    except BrokenPipeError:  # `python -m shardkit.info | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
    return 1 if info["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
