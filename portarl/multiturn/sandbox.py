"""``rollout.tool_isolation: process``: tools and environments run in a child process.

Why: in this process a hung call is ended from inside (:mod:`.calls`), which native code
that holds the interpreter and never returns does not allow; in a child it is killed. A
tool that crashes the interpreter (a segfault in a C extension, ``os._exit``) takes the
child down, not the run.

The child (``python -m portarl.multiturn.sandbox``: the standard library, portarl's light
modules and the user's, no torch) loads the tools and environment factories from the config's ``module:name`` strings and runs
:class:`~portarl.multiturn.operations.Operations` on requests; it speaks JSON lines
(a spec line, then one request per line, one reply per request) and never unpickles
anything. The parent (:class:`ProcessExecutor`) waits at most ``rollout.tool_timeout_s``
per reply; past it, or when the child dies, the child is killed and joined, the call gets
a ``timeout`` / ``lost`` outcome, and the environments it held are lost (their episodes end
with an error message); a new child starts at the next call. The child dies with its
parent (``PR_SET_PDEATHSIG``), its stdout is its stderr (a tool's prints cannot corrupt
the protocol), and it ignores SIGINT (the trainer decides when it stops).

Whatever a tool starts ends with the child: the child is the subreaper of its tools'
processes (a ``setsid`` or double-forked one stays in its tree), and killing it means
stopping and killing its whole tree and process group (:func:`portarl.runtime.lifeline.stop_child`),
after a timeout, when it crashed (its orphans came to the parent: :mod:`.leftovers`) and at
the run's end.

What the child does *not* isolate: it is not a sandbox. It runs as the trainer's user
with the trainer's environment variables, working directory and file system (a tool can
read, write and delete whatever the run can), network, devices and no resource limits
beyond the time limit per call (memory, CPU, processes, open files: set them in the tool,
or run it in a container). ``docs/agents.md`` says the same.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

from portarl.runtime.lifeline import stop_child
from portarl.multiturn.calls import CallOutcome
from portarl.multiturn.leftovers import Leftovers

#: The child's start-up (imports of portarl and the user's modules) gets at least this long.
STARTUP_MIN_S = 120.0


class ProcessExecutor:
    """``run(op, *args) -> CallOutcome`` in a child process (see the module docstring)."""

    def __init__(self, tool_specs: list[str], environment, search_dirs, timeout_s: float):
        for spec in tool_specs:
            if not isinstance(spec, str):
                raise ValueError("rollout.tool_isolation=process loads tools by 'module:function' name in the child "
                                 f"process; got the object {spec!r}")
        self.spec = {"tools": list(tool_specs), "environment": environment, "search_dirs": [str(d) for d in search_dirs],
                     "sys_path": list(sys.path)}
        self.timeout_s = timeout_s
        self.proc = None
        self.reader = None
        self.replies: queue.Queue = queue.Queue()
        self.live: set[str] = set()  # environments held by the current child
        self.restarts = 0
        self.leftovers = Leftovers()  # what a child that crashed left: its orphans come here

    # ---------------------------------------------------------------- lifecycle
    def _start(self) -> None:
        env = {**os.environ, "PORTARL_SANDBOX_PARENT": str(os.getpid())}
        self.proc = subprocess.Popen([sys.executable, "-m", "portarl.multiturn.sandbox"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
        self.replies = queue.Queue()
        self.reader = threading.Thread(target=self._read, args=(self.proc.stdout, self.replies),
                                       name="portarl-sandbox-reader", daemon=True)
        self.reader.start()
        self._send(self.spec)
        reply = self._receive(max(STARTUP_MIN_S, self.timeout_s))
        if reply is None or not reply.get("ready"):
            why = "hung" if reply is None else reply.get("error", "exited")
            self._stop()
            raise RuntimeError(f"the tool process (rollout.tool_isolation=process) did not start: {why}")

    @staticmethod
    def _read(stream, replies) -> None:
        for line in stream:
            replies.put(line)
        replies.put("")  # end of output: the child exited

    def _send(self, message: dict) -> bool:
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError, ValueError):
            return False

    def _receive(self, limit: float) -> dict | None:
        """The next reply; None when none came within ``limit`` (hung); {} when the child exited."""
        try:
            line = self.replies.get(timeout=limit)
        except queue.Empty:
            return None
        return json.loads(line) if line else {}

    def _stop(self) -> None:
        """Kill the child and join it and its reader (every exit path)."""
        proc, self.proc = self.proc, None
        self.live.clear()
        if proc is not None:
            stop_child(proc, self.reader)

    def close(self) -> None:
        self._stop()
        self.leftovers.close()

    # ------------------------------------------------------------------ calls
    def forget(self, key: str) -> None:
        self.live.discard(key)

    def run(self, op: str, *args) -> CallOutcome:
        key = args[0] if op.startswith("env_") else None
        if key is not None and op != "env_reset" and key not in self.live:
            return CallOutcome(False, kind="lost", error="the environment is gone (its process was restarted after a "
                                                         "call failed)")
        if self.proc is None:
            self._start()
        started = time.perf_counter()
        with self.leftovers.watch():
            reply = self._receive(self.timeout_s) if self._send({"op": op, "args": list(args)}) else {}
            if reply is None or not reply:
                code = self.proc.poll() if self.proc is not None else None
                self._stop()  # the child and its whole tree (a crashed one's orphans came here meanwhile)
        if reply is None or not reply:
            self.leftovers.end()
            self.restarts += 1
            if reply is None:
                return CallOutcome(False, kind="timeout", elapsed_s=time.perf_counter() - started,
                                   error=f"did not return within rollout.tool_timeout_s={self.timeout_s:g} s; its "
                                         "process was killed")
            return CallOutcome(False, kind="lost", elapsed_s=time.perf_counter() - started,
                               error=f"ended its process (exit code {code})")
        if op == "env_reset":
            self.live.add(key)
        elif op == "env_close":
            self.live.discard(key)
        return CallOutcome(bool(reply["ok"]), reply.get("value"), reply.get("kind"), reply.get("error"),
                           float(reply.get("elapsed_s", 0.0)))


def main() -> int:
    """The child: a spec line, then requests until stdin closes."""
    from portarl.runtime.lifeline import adopt_orphans, die_with_parent
    from portarl.multiturn.calls import run_captured
    from portarl.multiturn.environment import load_factories
    from portarl.multiturn.operations import OPS, Operations
    from portarl.multiturn.tools import load_tools

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(int(os.environ.get("PORTARL_SANDBOX_PARENT", os.getppid())))
    adopt_orphans()  # before any tool runs: nothing it starts can leave this tree
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # prints of the user's code go to stderr, never into the protocol
    sys.stdout = sys.stderr
    spec = json.loads(sys.stdin.readline())
    sys.path[:] = spec["sys_path"]
    try:
        ops = Operations(load_tools(spec["tools"], spec["search_dirs"], with_schema=False),
                         load_factories(spec["environment"], spec["search_dirs"]))
        out.write(json.dumps({"ready": True}) + "\n")
    except Exception as err:  # noqa: BLE001 - reported to the parent, which names it
        out.write(json.dumps({"ready": False, "error": f"{type(err).__name__}: {err}"}) + "\n")
        return 1
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        op = request["op"]
        got = run_captured(getattr(ops, op), tuple(request["args"]), {}) if op in OPS else None
        reply = ({"ok": False, "kind": "raised", "error": f"unknown operation {op!r}"} if got is None else
                 {"ok": got.ok, "value": got.value, "kind": got.kind, "error": got.error, "elapsed_s": got.elapsed_s})
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
