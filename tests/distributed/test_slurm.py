"""Issue 62: the Slurm recipe (examples/slurm/portarl.sbatch, shown in docs/distributed.md)
run as Slurm would run it, on one machine: two "nodes" of 2 Gloo ranks each, the rendezvous
computed from Slurm's variables, stopped mid-run as a preemption or a time limit stops it
(SIGTERM to each node's task) and requeued (the same file again, same job id), which
continues from the checkpoint to the end with --resume-or-start; rank 0 alone logs to the
experiment tracker (Trackio, when installed), and the requeued job continues its run.

``srun`` and ``scontrol`` are not installed here: stand-ins on PATH do their part. ``srun``
runs its command once per node with that node's ``SLURM_NODEID`` (each node's output in a
file of its own), and waits for all; ``scontrol show hostnames`` lists the node list. The
script itself runs unchanged, top to bottom, under bash.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from proc_tree import children, free_port, kill_tree  # noqa: E402

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find each node's task"),
              pytest.mark.skipif(shutil.which("bash") is None, reason="the sbatch script is a bash script")]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "slurm" / "portarl.sbatch"
STEPS = 8
#: Longest one submission may take, whatever the machine's load (a hang fails, not waits).
RUN_LIMIT_S = 480
CONFIG = f"""\
model: {{hidden_size: 32, intermediate_size: 64}}
data: {{synthetic_size: 64}}
rollout: {{group_size: 4, max_new_tokens: 3}}
train: {{steps: {STEPS}, prompts_per_step: 4, sft_warmup_steps: 0, micro_batch_size: 4}}
optim: {{lr: 1.0e-3}}
checkpoint: {{every: 1, keep_last: 2}}
logging: {{progress: false, plot: false, trackers: [{'trackio' if importlib.util.find_spec('trackio') else ''}]}}
"""

SRUN = """\
#!{python}
# srun's part for the test: its command once per node (SLURM_NNODES), each with that node's
# SLURM_NODEID and its output in $SRUN_LOG_DIR/node-<id>.log; waits for every node and exits
# with the first failure's status. SIGTERM is for the tasks (the test sends it to them).
import os, signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
argv = sys.argv[1:]
while argv and argv[0].startswith("-"):
    argv.pop(0)
procs = []
for node in range(int(os.environ["SLURM_NNODES"])):
    env = {{**os.environ, "SLURM_NODEID": str(node), "SLURM_PROCID": str(node), "SLURM_LOCALID": "0"}}
    log = open(os.path.join(os.environ["SRUN_LOG_DIR"], f"node-{{node}}.log"), "w")
    procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
codes = [p.wait() for p in procs]
sys.exit(next((c for c in codes if c), 0))
"""

SCONTROL = """\
#!{python}
# scontrol show hostnames LIST, for comma-separated lists
import sys
assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
print("\\n".join(sys.argv[3].split(",")))
"""


class Job:
    """One submission of the sbatch script: bash runs it with Slurm's variables set."""

    def __init__(self, root: Path, name: str):
        self.logs = root / name
        self.logs.mkdir()
        stubs = root / "bin"
        if not stubs.exists():
            stubs.mkdir()
            for tool, text in (("srun", SRUN), ("scontrol", SCONTROL)):
                (stubs / tool).write_text(text.format(python=sys.executable))
                (stubs / tool).chmod(0o755)
        env = {**os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}", "SRUN_LOG_DIR": str(self.logs),
               "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "portarl", "SLURM_NNODES": "2",
               "SLURM_JOB_NODELIST": "localhost,127.0.0.1", "MASTER_PORT": str(free_port()),
               "CONFIG": str(root / "config.yaml"), "OUTPUT_DIR": str(root / "run"), "DEVICE": "cpu",
               "NPROC_PER_NODE": "2", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
               "HOME": str(root / "home"), "TRACKIO_DIR": str(root / "trackio")}
        env.pop("TRITON_INTERPRET", None)
        self.proc = subprocess.Popen(["bash", str(SCRIPT)], cwd=root, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def output(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(self.logs.glob("node-*.log")))

    def tasks(self) -> list[int]:
        """Each node's task (its torchrun agent): the stand-in srun's children."""
        srun = [pid for pid in children(self.proc.pid)]
        return [task for pid in srun for task in children(pid)]

    def wait(self) -> int:
        out, _ = self.proc.communicate(timeout=RUN_LIMIT_S)
        self.batch_output = out
        return self.proc.returncode

    def close(self) -> None:
        if self.proc.poll() is None:
            kill_tree(self.proc.pid)
            self.proc.wait()


@contextlib.contextmanager
def submitted(root: Path, name: str):
    job = Job(root, name)
    try:
        yield job
    finally:
        job.close()


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_docs_show_the_script_as_shipped():
    """docs/distributed.md holds the script in full (it reads on GitHub as on the site): the
    text between its markers is the file, byte for byte."""
    page = (REPO / "docs" / "distributed.md").read_text()
    begin = page.index("<!-- SBATCH_SCRIPT:")
    block = page[page.index("```bash\n", begin) + len("```bash\n"): page.index("```\n<!-- /SBATCH_SCRIPT -->", begin)]
    assert block == SCRIPT.read_text(), "docs/distributed.md's sbatch script differs from examples/slurm/portarl.sbatch"


def test_the_sbatch_script_trains_on_two_nodes_and_a_requeued_job_continues(tmp_path):
    (tmp_path / "config.yaml").write_text(CONFIG)
    out = tmp_path / "run"
    from portarl.trainer.checkpoint import CheckpointManager

    # The first submission, stopped after its second checkpoint as Slurm stops a job it
    # preempts or whose time is up (--signal=TERM@300): SIGTERM to each node's task.
    with submitted(tmp_path, "first") as job:
        deadline = time.monotonic() + RUN_LIMIT_S
        while not (out / "checkpoints" / "step-000002" / "COMPLETE").exists():
            assert job.proc.poll() is None, job.output()[-6000:]
            assert time.monotonic() < deadline, "the job did not reach step 2"
            time.sleep(0.2)
        tasks = job.tasks()
        assert len(tasks) == 2, f"one task per node: {tasks}"
        for task in tasks:
            os.kill(task, signal.SIGTERM)
        code = job.wait()
        first = job.output()
    assert code != 0, "a stopped job ends non-zero (Slurm requeues it)"
    assert "stopped by SIGTERM after step" in first and "checkpoint saved" in first, first[-6000:]
    stopped = _rows(out)[-1]["step"]
    assert 2 <= stopped < STEPS, f"stopped at step {stopped}: the job must stop before its end"
    latest = CheckpointManager(out).latest()
    assert CheckpointManager.load_state(latest)["step"] == stopped

    # The requeue: the same script, job id and arguments.
    with submitted(tmp_path, "requeued") as job:
        code = job.wait()
        second = job.output()
    assert code == 0, second[-6000:]
    assert f"(step {stopped})" in second and "resumed from" in second, second[-6000:]
    assert [row["step"] for row in _rows(out)] == list(range(1, STEPS + 1)), "the steps continue, none twice"
    latest = CheckpointManager(out).latest()
    assert CheckpointManager.load_state(latest)["step"] == STEPS and CheckpointManager.is_sharded(latest)
    assert sorted(p.name for p in (latest / "dcp").glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)], \
        "4 ranks: 2 nodes x 2"
    for text in (first, second):
        assert "returned a view tensor" not in text, "FSDP2's view warning (tests/distributed/test_console.py)"

    if importlib.util.find_spec("trackio") is None:
        return  # the tracker's part needs Trackio (pip install 'portarl[trackio]')
    code = ("import json, tracker_readers; runs = tracker_readers.trackio_runs('portarl'); "
            "print(json.dumps({k: v['metric_rows'] for k, v in runs.items()}))")
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "HOME": str(tmp_path / "home"),
           "PYTHONPATH": str(REPO / "tests" / "trainer")}
    read = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=True)
    runs = json.loads(read.stdout.splitlines()[-1])
    assert runs == {"run": list(range(1, STEPS + 1))}, f"one run (rank 0's), continued by the requeue: {runs}"
