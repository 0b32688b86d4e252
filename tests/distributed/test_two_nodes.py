"""A job across nodes, as two torchrun agents on this machine (issue 49): ``--nnodes 2``,
c10d rendezvous on localhost, one rank each, Gloo on the CPU.

- it trains, saves sharded (DCP) checkpoints holding both nodes' shards, and a resume on
  two agents again reproduces the uninterrupted run bitwise (as one process's resume does,
  tests/trainer/test_resume.py);
- a node that dies (its agent and its rank SIGKILLed) stops the other within
  ``distributed.timeout_s``, with one line naming the lost rank, its node and host (or the
  rendezvous store, when the dead node kept it);
- an output directory that is not one directory for every node is refused at start.

Each agent's output goes to a file (two pipes read one after the other could fill and stall
the job), and every process an agent started is killed and waited for on every exit path.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import run_guard  # noqa: E402
from portarl.trainer.checkpoint import CheckpointManager  # noqa: E402
from proc_tree import free_port, kill_tree, tree  # noqa: E402
from test_fsdp_gloo import FAST, _env, _params_from, _rows  # noqa: E402

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find each node's rank")

TIMEOUT_S = 20  # distributed.timeout_s of the dying-node runs: the heartbeat gives up on a rank at 10 s
#: What a resumed step must reproduce exactly (tests/trainer/test_resume.py's list).
COMPARED = ("reward/mean", "loss", "grad_norm", "kl", "completion/len_mean")
#: Longest a run of these tests may take, whatever the machine's load (a hang fails, not waits).
RUN_LIMIT_S = 400


class Agents:
    """Two torchrun agents, one rank each, joined by a c10d rendezvous on localhost; node 0's
    agent keeps the rendezvous store (``is_host``), as the endpoint's node does on a cluster."""

    def __init__(self, logs: Path, outs: list[Path], *sets: str, resume: bool = False, node1: tuple[str, ...] = ()):
        port, self.procs, self.logs = free_port(), [], []
        self.started = time.monotonic()
        try:
            for node, out in enumerate(outs):
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                       "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes",
                       "--rdzv-conf", f"is_host={int(node == 0)}", "--max-restarts", "0",
                       "-m", "portarl", "train", "--device", "cpu", "--output-dir", str(out)]
                for item in (*FAST, *sets, *(node1 if node else ())):
                    cmd += ["--set", item]
                if resume:
                    cmd.append("--resume")
                self.logs.append(logs.parent / f"{logs.name}-node{node}.log")
                with open(self.logs[-1], "w") as log:
                    self.procs.append(subprocess.Popen(cmd, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                                                       start_new_session=True))
        except BaseException:
            self.close()
            raise

    def output(self, node: int) -> str:
        return self.logs[node].read_text()

    def wait(self, limit_s: float = RUN_LIMIT_S) -> list[int]:
        """Both agents' exit statuses (a run past ``limit_s`` fails the test)."""
        deadline = time.monotonic() + limit_s
        for proc in self.procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        return [proc.returncode for proc in self.procs]

    def rank_of(self, node: int) -> tuple[int, int]:
        """The rank and node number (``GROUP_RANK``) the rendezvous gave agent ``node``'s
        worker: c10d numbers both by arrival, not by the order the agents were started."""
        for pid in tree(self.procs[node].pid)[1:]:
            with contextlib.suppress(OSError):
                env = dict(e.split(b"=", 1) for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in e)
                if b"RANK" in env:
                    return int(env[b"RANK"]), int(env[b"GROUP_RANK"])
        raise AssertionError(f"agent {node} runs no rank")

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                kill_tree(proc.pid)
            proc.wait()


@contextlib.contextmanager
def agents(logs: Path, outs: list[Path], *sets: str, resume: bool = False, node1: tuple[str, ...] = ()):
    job = Agents(logs, outs, *sets, resume=resume, node1=node1)
    try:
        yield job
    finally:
        job.close()


def _run(logs: Path, outs: list[Path], *sets: str, resume: bool = False) -> list[str]:
    """Run two agents to the end; both must exit 0. Returns their outputs."""
    with agents(logs, outs, *sets, resume=resume) as job:
        codes = job.wait()
        outputs = [job.output(0), job.output(1)]
    assert codes == [0, 0], "\n".join(o[-3000:] for o in outputs)
    return outputs


@pytest.mark.compares_runs
def test_two_nodes_train_save_sharded_checkpoints_and_resume_as_the_uninterrupted_run(tmp_path):
    whole = tmp_path / "whole"
    _run(tmp_path / "whole", [whole, whole], "train.steps=4", "checkpoint.keep_last=4")
    assert [row["step"] for row in _rows(whole)] == [1, 2, 3, 4]
    run_guard.assert_run_trained(whole, what="the uninterrupted two-node run")
    manager = CheckpointManager(whole)
    assert [CheckpointManager.load_state(c)["step"] for c in manager.complete()] == [1, 2, 3, 4]
    for checkpoint in manager.complete():  # DCP: both nodes' shards, in the one directory
        assert CheckpointManager.is_sharded(checkpoint)
        assert sorted(p.name for p in (checkpoint / "dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]

    # The same run, lost after step 2: its nodes went down before step 3's checkpoint and log
    # rows reached the disk. Two agents continue it with --resume.
    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    for step in (3, 4):
        shutil.rmtree(resumed / "checkpoints" / f"step-{step:06d}")
    lines = (resumed / "metrics.jsonl").read_text().splitlines(keepends=True)
    (resumed / "metrics.jsonl").write_text("".join(lines[:2]))
    # distributed.timeout_s may change on --resume (it changes no result; docs/distributed.md).
    outputs = _run(tmp_path / "resume", [resumed, resumed], "train.steps=4", "checkpoint.keep_last=4",
                   "distributed.timeout_s=300", resume=True)
    assert any("resumed from" in o and "(step 2)" in o for o in outputs), outputs[0][-3000:]

    rows, expected = _rows(resumed), _rows(whole)
    assert [row["step"] for row in rows] == [1, 2, 3, 4], "metrics continue without gaps or duplicates"
    # the steps compared trained: the resumed steps 3 and 4 moved the weights they resumed from
    run_guard.assert_trained(run_guard.grad_norms(resumed)[2:],
                             run_guard.checkpoint_weights(resumed / "checkpoints" / "step-000002"),
                             run_guard.checkpoint_weights(resumed), what="the resumed steps 3-4")
    for got, want in zip(rows[2:], expected[2:]):
        for key in COMPARED:
            assert got[key] == want[key], f"step {got['step']} {key}: resumed {got[key]} vs uninterrupted {want[key]}"
    latest = CheckpointManager(resumed).latest()
    assert CheckpointManager.is_sharded(latest) and CheckpointManager.load_state(latest)["step"] == 4
    after, want = _params_from(latest), _params_from(manager.latest())
    assert all(torch.equal(after[k], want[k]) for k in want), "the resumed weights equal the uninterrupted run's"


@pytest.mark.parametrize("dead", [1, 0], ids=["node1", "node0_keeping_the_store"])
def test_a_node_that_dies_stops_the_other_within_the_timeout_naming_it(tmp_path, dead):
    out = tmp_path / "run"
    with agents(tmp_path / "run", [out, out], "train.steps=400", f"distributed.timeout_s={TIMEOUT_S}") as job:
        metrics, deadline = out / "metrics.jsonl", time.monotonic() + RUN_LIMIT_S
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
            assert all(p.poll() is None for p in job.procs), job.output(0)[-3000:] + job.output(1)[-3000:]
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        # The scheduling margin is this run's own start-up time (launch to first step): on a
        # loaded machine both stretch alike, so load slows the test but cannot fail it.
        margin = max(10.0, time.monotonic() - job.started)
        (lost, lost_node), survivor = job.rank_of(dead), job.procs[1 - dead]
        kill_tree(job.procs[dead].pid)
        killed = time.monotonic()
        survivor.wait(timeout=RUN_LIMIT_S)
        took = time.monotonic() - killed
        output = job.output(1 - dead)
    assert survivor.returncode != 0, output[-4000:]
    assert took < TIMEOUT_S + margin, f"the other node stopped {took:.0f} s after the death ({output[-3000:]})"
    # One line says it: the failed collective's (portarl/cli/train.py), or, if the heartbeat
    # saw the loss first, the heartbeat's (logged, and printed where no logging is set up).
    said = {re.search(r"portarl(?: train)?: (.*)", line).group(1) for line in output.splitlines() if (
        "another rank's process ended" in line or "stopped answering" in line or "has sent no heartbeat" in line)}
    assert len(said) == 1, output[-4000:]
    line = said.pop()
    if dead == 1:  # the survivor keeps the store: it names the rank, its node and host
        assert f"rank {lost} (node {lost_node}, host {socket.gethostname()})" in line or f"rank {lost} has sent no heartbeat" \
            in line, line
    else:  # the dead node kept the rendezvous store: the line says so
        assert "rendezvous store" in line and "stopped answering" in line, line


def test_an_output_dir_that_not_every_node_sees_is_refused(tmp_path):
    """The same path on two nodes is two directories unless it is on a shared filesystem;
    here each agent is given a directory of its own, which is what a node's local disk
    looks like to the check (rank 0's file is not in the other rank's directory)."""
    dirs = [tmp_path / "node0-disk", tmp_path / "node1-disk"]
    with agents(tmp_path / "local", dirs, "train.steps=2") as job:
        codes = job.wait()
        outputs = [job.output(0), job.output(1)]
    assert all(code != 0 for code in codes), outputs
    for output in outputs:  # every rank stops with the same line (none waits for the others)
        said = [line for line in output.splitlines() if "is not shared by every rank" in line]
        assert len(said) == 1 and said[0].startswith("portarl train: output_dir (--output-dir)"), output[-3000:]
        assert "filesystem every node mounts at the same path" in said[0]
    for directory in dirs:
        assert not (directory / "checkpoints").exists() and not (directory / "metrics.jsonl").exists()
        assert not list(directory.glob(".portarl-shared-*")), "the probe file is removed"


def test_a_node_that_fails_to_start_stops_the_other_at_once(tmp_path):
    """Node 1's rank stops before it joins the process group (here a setting it alone was
    given; on a cluster, e.g. --resume where its directory holds no checkpoint). Node 0's
    rank, waiting for it in init_process_group, stops as soon as that is known, naming it,
    instead of after distributed.timeout_s with a timeout that names no rank."""
    out, limit = tmp_path / "run", 300
    with agents(tmp_path / "run", [out, out], "train.steps=2", f"distributed.timeout_s={limit}",
                node1=("train.micro_batch_size=0",)) as job:
        codes = job.wait(limit_s=RUN_LIMIT_S)
        took = time.monotonic() - job.started
        outputs = [job.output(0), job.output(1)]
    assert codes[0] != 0 and codes[1] != 0, outputs
    assert took < limit, f"node 0 waited {took:.0f} s (distributed.timeout_s={limit})"
    said = [line for line in outputs[0].splitlines() if "stopped before the job began" in line]
    assert len(said) == 1 and re.match(r"portarl train: rank [01]: rank [01] \(node [01], host ", said[0]), \
        outputs[0][-3000:]
    assert any("micro_batch_size" in line for line in outputs[1].splitlines()), outputs[1][-3000:]
