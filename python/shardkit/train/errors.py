"""The one exception class of ``python -m shardkit.train`` for a user's mistake.

``cli.main`` turns a :class:`UsageError` into one line on stderr and exit status 2; any
other exception is ours (a bug) and keeps its traceback (exit status 1).
"""

from __future__ import annotations


class UsageError(Exception):
    """A user error: the message says what is wrong and what to do."""


def cannot_write(path: str, e: BaseException) -> UsageError:
    """The one-line error of a file the run cannot write (a full disk, a read-only place):
    the reason of the OSError behind ``e`` (``torch.save`` reports ENOSPC as a RuntimeError
    "unexpected pos" whose context is the OSError), else ``e``'s first line."""
    reason = None
    seen: BaseException | None = e
    while seen is not None and reason is None:
        if isinstance(seen, OSError) and seen.strerror:
            reason = seen.strerror
        seen = seen.__cause__ or seen.__context__
    if reason is None:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return UsageError(f"cannot write {path}: {reason}; free space there or give another --out")
