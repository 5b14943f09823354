"""How ``python -m shardkit.train`` fails under torchrun: every rank's error reaches the user.

* A rank that meets an error prints its own line (``[rank R of W]`` after ``error:``), rank 0
  or not, and records it in the process group's store; the first failure is kept (an atomic
  compare-and-set), and a rank whose error is the same line as the recorded one does not
  print it again.
* The other ranks stop at their next collective: the failed rank's process is gone, so the
  transport raises ("Connection closed by peer"), or the launcher sends SIGTERM. Either way
  they look the record up and print one line naming the rank that failed and its error,
  instead of the transport's traceback.
* A rank killed outright (SIGKILL, the out-of-memory killer) records nothing: the others'
  collectives fail and each prints one line saying so (exit 1), no transport traceback.
* Exit status: 2 for a user error (this rank's or the failed rank's), 1 with a traceback for an
  internal error, 143 when the launcher stopped a rank and no failure was recorded; torchrun
  then exits non-zero and names the first rank that failed.

Before the process group exists (a bad flag, a missing file) each rank prints its own line:
the ranks of other machines may see other files.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from types import FrameType
from typing import Iterator, Optional, Tuple

import torch.distributed as dist

from shardkit.train.world import World

PROG = "python -m shardkit.train"
KEY = "shardkit.train/first-failure"


class Terminated(BaseException):
    """SIGTERM from the launcher (torchrun stops the other ranks when one fails)."""


def tag(rank: int, size: int) -> str:
    """``[rank R of W] `` under torchrun, else nothing."""
    return f"[rank {rank} of {size}] " if size > 1 else ""


def env_tag() -> str:
    """The tag of this process before the process group exists (from torchrun's environment)."""
    try:
        return tag(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return ""


def say(line: str) -> None:
    """One line on stderr; nothing if stderr is gone."""
    try:
        print(f"{PROG}: error: {line}", file=sys.stderr, flush=True)
    except (BrokenPipeError, ValueError, OSError):
        pass


def _store() -> Optional[dist.Store]:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None


def record(world: World, code: int, line: str) -> bool:
    """Records this rank's failure unless one was recorded first; returns True when the
    recorded failure is another rank's with the same line (already printed there)."""
    store = _store() if world.size > 1 else None
    if store is None:
        return False
    mine = f"{world.rank}\t{code}\t{line}"
    try:
        stored = store.compare_set(KEY, "", mine)
    except Exception:  # noqa: BLE001 (the store is gone: nothing to record into)
        return False
    first = stored.decode(errors="replace") if isinstance(stored, bytes) else str(stored)
    if first == mine:
        return False
    return first.split("\t", 2)[-1] == line


def peer_failure(world: World) -> Optional[Tuple[int, int, str]]:
    """(rank, exit code, line) of another rank's recorded failure, else None."""
    store = _store() if world.size > 1 else None
    if store is None:
        return None
    try:
        if not store.check([KEY]):
            return None
        rank, code, line = store.get(KEY).decode(errors="replace").split("\t", 2)
    except Exception:  # noqa: BLE001 (the store is gone or holds something else)
        return None
    if int(rank) == world.rank:
        return None
    return int(rank), int(code), line


def fail(world: World, code: int, line: str) -> int:
    """This rank's user error: recorded, printed (once across ranks), ``code`` returned."""
    if not record(world, code, line):
        say(tag(world.rank, world.size) + line)
    return code


def stopped_by_peer(world: World, peer: Tuple[int, int, str], own: BaseException) -> int:
    """This rank stopped because ``peer`` failed first: one line naming it; its exit code."""
    rank, code, line = peer
    why = "stopped by the launcher" if isinstance(own, Terminated) else "its collective failed"
    say(f"{tag(world.rank, world.size)}stopped ({why}) because rank {rank} failed: {line}")
    return code


# What a collective raises when a peer's process is gone or stopped answering (gloo, NCCL).
_TRANSPORT = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "timed out", "Timed out")


def transport_failure(e: BaseException) -> bool:
    """Whether ``e`` is a collective that failed because another rank went away (a peer
    killed by a signal or the out-of-memory killer records no failure of its own)."""
    backend_error = getattr(dist, "DistBackendError", None)
    if backend_error is not None and isinstance(e, backend_error):
        return True
    return isinstance(e, RuntimeError) and any(s in str(e) for s in _TRANSPORT)


def stopped_by_lost_peer(world: World, own: BaseException) -> int:
    """This rank's collective failed and no rank recorded an error: one line, exit 1."""
    said = (str(own).strip().splitlines() or [type(own).__name__])[0][:200]
    say(
        f"{tag(world.rank, world.size)}stopped because a collective failed ({said}): another rank stopped "
        "without reporting an error (killed by a signal or out of memory?); torchrun's summary names it, and "
        "--resume continues from the last checkpoint"
    )
    return 1


@contextlib.contextmanager
def sigterm_raises(world: World) -> Iterator[None]:
    """Under torchrun, SIGTERM raises :class:`Terminated` in the main thread (so the rank can
    say why it stops); the previous handler is restored after."""
    if world.size <= 1 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigterm(signum: int, frame: Optional[FrameType]) -> None:
        raise Terminated

    old = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
