"""The run's log, ``<--out>/log.txt``: the header, progress lines, warnings and results, as
printed (progress as plain lines even when the terminal shows a bar). A resumed run appends."""

from __future__ import annotations

import os
import sys
import time
from typing import Optional, Set, TextIO

from shardkit.train.errors import cannot_write


def emit(text: str, stream: Optional[TextIO] = None) -> None:
    """``print(text)`` to stdout (or ``stream``), flushed; when the reader has left (``python -m
    shardkit.train ... | head``), the stream goes to /dev/null from then on and the run goes
    on: everything is in log.txt."""
    stream = sys.stdout if stream is None else stream
    try:
        print(text, file=stream, flush=True)
    except BrokenPipeError:
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())  # no second error at exit
        except (OSError, ValueError):
            pass


def _printable(text: str) -> str:
    """``text`` with what UTF-8 cannot encode (a path's undecodable bytes, which Python keeps
    as lone surrogates) written as backslash escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class RunLog:
    """Print and log lines (on rank 0; other ranks neither print nor write)."""

    def __init__(self, out_dir: str, enabled: bool, append: bool = False) -> None:
        self.enabled = enabled
        self.file: Optional[TextIO] = None
        self._warned: Set[str] = set()
        self.path = os.path.join(out_dir, "log.txt")
        if enabled:
            os.makedirs(out_dir, exist_ok=True)
            self.file = open(self.path, "a" if append else "w", encoding="utf-8")
            self.write(f"---- {time.strftime('%Y-%m-%d %H:%M:%S')} ----")

    def write(self, text: str) -> None:
        """To the log file only; a write that fails (a full disk) is a UsageError naming the
        file, and nothing more is written to it."""
        text = _printable(text)
        if self.file is not None:
            try:
                self.file.write(text.rstrip("\n") + "\n")
                self.file.flush()
            except OSError as e:
                self.close()
                raise cannot_write(self.path, e) from None

    def line(self, text: str = "") -> None:
        """Printed on stdout and written to the log."""
        if self.enabled:
            emit(_printable(text))
            self.write(text)

    def warn(self, text: str) -> None:
        """``warning: ...`` on stderr and in the log, once per distinct text."""
        if self.enabled and text not in self._warned:
            self._warned.add(text)
            emit(f"warning: {_printable(text)}", sys.stderr)
            self.write(f"warning: {text}")

    def close(self) -> None:
        """Closes the file; what it could not write was reported already (by :meth:`write`)."""
        file, self.file = self.file, None
        if file is not None:
            try:
                file.close()
            except OSError:
                pass
