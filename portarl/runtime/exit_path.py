"""How a torchrun rank leaves: the one exit path of every entry point that can run under
torchrun, in an order that cannot abort.

The failure this prevents: a 2-rank job trained and saved both checkpoints, then one rank
died at exit with ``terminate called without an active exception`` (SIGABRT) and torchrun
marked the finished job failed. Cause: the Gloo backend's C++ threads outlive
``destroy_process_group()``. That call only unregisters the group; the backend object lives
while anything references it, and DTensor's global sharding and redistribution caches keep
device meshes (which hold the group) alive after every model is gone. Measured on this
code: both ``pt_gloo_runloop`` worker threads and the ``gloo_tcp_loop`` thread are still
running after ``destroy_process_group()`` and a full garbage collection. Interpreter
finalisation then tears down the backend, or a worker thread still releasing a finished
collective's tensors takes the GIL while the interpreter finalises; CPython ends such a
thread with ``pthread_exit``, whose unwinding through a ``noexcept`` C++ frame calls
``std::terminate``. It needs a worker thread to lag behind the main thread at exit, so it
strikes at random, more often on a loaded machine (pytorch/pytorch#190489 describes the
same unwinding).

The order here:

1. :func:`portarl.runtime.distributed.leave_job`: portarl's own threads stop and are joined (the heartbeat; the
   trainer's logger, rollout engine and progress bars are closed by the caller before it
   lets go of the trainer);
2. on an agreed exit, every rank meets at a barrier held in the rendezvous *store*, not a
   collective, so no new work reaches the backend's threads and no rank closes its sockets
   while a peer is still inside a collective with it; a rank leaving alone (an error on this
   rank, a second signal) does not wait for peers that are not coming;
3. ``destroy_process_group()``;
4. :func:`leave_process`: the rank ends with ``os._exit`` after flushing logs and the
   standard streams. No interpreter finalisation runs, so no thread of any library (Gloo's
   workers and transport loop, OpenMP's pool) can race it; those threads are idle or blocked
   and end with the process. Everything of value is on disk by then: the checkpoint
   (written and verified collectively), the logs (closed), the summary (printed).
"""

from __future__ import annotations

import logging
import os
import sys


def leave_process(code: int) -> None:
    """Step 4: end this rank now with ``code``, skipping interpreter finalisation. Only for
    a process that joined a torchrun job (:func:`portarl.runtime.distributed.joined_a_job`); an
    entry point that has not left the job yet leaves it alone first (no barrier)."""
    from portarl.runtime import blackbox
    from portarl.runtime import distributed as pdist

    blackbox.declare(code)  # an exit of its own (portarl.runtime.supervisor)
    pdist.shutdown(agreed=False)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing more to say
            pass
    os._exit(code)
