"""A stand-in for a supervised command (tests/test_supervisor.py): portarl.runtime.supervisor's
parent around a child that does what ``argv[1]`` says, in a process that never imports
torch (so each case costs a fraction of a second). ``argv[2]``: the run's output directory.

- ``finished``: the child declares exit 0 and exits 0 (a run that reached its end);
- ``exit0``: it dies with ``os._exit(0)`` inside a recorded reward call in step 3;
- ``sigkill``: it is SIGKILLed (the OOM killer) in step 3;
- ``finished-then-abort``: it declares 0, then aborts (a crash at interpreter exit);
- ``failed-then-abort``: it declares 4 (a named failure, e.g. a full disk), then aborts;
- ``signals``: it prints ``ready``, then one line per SIGINT / SIGTERM it receives, and
  exits 0 (declared) once ``<output_dir>/done`` exists.
"""

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from portarl.runtime import blackbox
from portarl.runtime import supervisor

scenario, out = sys.argv[1], Path(sys.argv[2])
args = argparse.Namespace(command="train", argv=["train", "--output-dir", str(out)])
parent = supervisor.Supervisor(args)
if parent.fork():  # the child
    blackbox.note(output_dir=out, step=3, phase="scoring")
    if scenario == "exit0":
        blackbox.enter_call("reward 'r'", "sample 0 (prompt '1+1=')")
        os._exit(0)
    if scenario == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if scenario == "signals":
        def on_signal(signum, frame):
            print(f"got {signal.Signals(signum).name}", flush=True)

        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, on_signal)
        print("ready", flush=True)
        while not (out / "done").exists():
            time.sleep(0.01)
    if scenario == "failed-then-abort":
        blackbox.declare(4)
        os.abort()
    blackbox.declare(0)
    sys.stdout.flush()
    if scenario == "finished-then-abort":
        os.abort()
    os._exit(0)
code = parent.wait()
print(f"parent imported torch: {'torch' in sys.modules}", flush=True)
sys.exit(code)
