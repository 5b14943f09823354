"""The end of a spawned test rank: tear the process group down together, then leave at once.

Gloo's worker threads can outlive ``destroy_process_group`` briefly; a process that runs its
interpreter and C++ static destructors while one of them still reads a peer's socket aborts
with "terminate called without an active exception" (seen in CI, after every result had been
written and was correct). So a rank saves its results first, drops what holds the group
(DDP's reducer, a head's exchange), waits for every rank with a barrier that completes by
explicit acknowledgements, destroys the group, and exits with ``os._exit`` so no destructor
of torch's runs after that. The test process then checks the saved results and the ranks'
exit codes as before: a rank that fails before this point still fails the test.
"""

import gc
import os
import sys
import traceback
from datetime import timedelta

import torch.distributed as dist


def end_rank(timeout_s: float = 120.0) -> None:
    """Barrier, destroy the default group, flush, and exit: status 0, or 1 if the barrier failed."""
    gc.collect()  # the DDP reducer / exchange buffers the caller dropped go now, not at exit
    status = 0
    try:
        if dist.is_initialized():
            dist.monitored_barrier(timeout=timedelta(seconds=timeout_s))
    except Exception:
        traceback.print_exc()
        status = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
