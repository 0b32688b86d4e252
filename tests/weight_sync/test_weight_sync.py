"""Weight sync through a process group with real processes: a sender (the trainer's rank 0)
and two receivers over Gloo, bitwise at every version, a sender SIGKILLed mid-bucket, a slow
sender that is alive."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from sync_peer import version_tensors  # noqa: E402

safetensors = pytest.importorskip("safetensors.torch")

#: The group's timeout (one bucket's transfer) where a test needs to tell it from liveness.
TIMEOUT_S = 300
#: Bound of one whole group run: a hang fails the test instead of holding CI.
RUN_LIMIT_S = 2 * TIMEOUT_S


def _env():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    return env


def _run_group(out: Path, *extra: str, receivers: int = 2, sender_extra=()) -> dict:
    """Start the sender and the receivers, wait for all, return ``{rank: (code, output)}``."""
    out.mkdir(parents=True, exist_ok=True)
    world = receivers + 1
    common = ["--out", str(out), "--world", str(world), *extra]
    cmds = [[sys.executable, str(HERE / "sync_peer.py"), "sender", *common, *sender_extra]]
    cmds += [[sys.executable, str(HERE / "sync_peer.py"), "receiver", "--rank", str(r), *common]
             for r in range(1, world)]
    procs = [subprocess.Popen(c, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in cmds]
    results = {}
    try:
        for rank, proc in enumerate(procs):
            output, _ = proc.communicate(timeout=RUN_LIMIT_S)
            results[rank] = (proc.returncode, output)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (NaN payloads, -0.0 and subnormals compared exactly)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _assert_bitwise(path: Path, version: int) -> None:
    got = safetensors.load_file(str(path))
    want = dict(version_tensors(version))
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(_bits(got[name]), _bits(tensor)), f"{name} differs in version {version}"


@pytest.mark.parametrize("checksum", [False, True], ids=["counts", "crc32"])
def test_two_receivers_get_every_version_bitwise(tmp_path, checksum):
    results = _run_group(tmp_path, "--versions", "3", *(["--checksum"] if checksum else []))
    for rank, (code, output) in results.items():
        assert code == 0, f"rank {rank}:\n{output[-3000:]}"
    stats = [json.loads(line) for line in (tmp_path / "sender.jsonl").read_text().splitlines()]
    assert [s["version"] for s in stats] == [1, 2, 3]
    assert all(s["buckets"] >= 4 for s in stats), "the versions must span several buckets of each dtype"
    for rank in (1, 2):
        for version in (1, 2, 3):
            _assert_bitwise(tmp_path / f"rank{rank}" / f"v{version}.safetensors", version)


def test_sender_killed_mid_bucket_leaves_receivers_on_the_previous_version(tmp_path):
    """The sender is SIGKILLed 50 ms after it starts version 2's bucket of 64 MiB (its
    header published, its broadcast begun, a transfer of ~0.1 s here when both sides run): no
    receiver loads version 2; each says so and keeps version 1, found by liveness (the
    sender's store is gone), not by the transfer's timeout."""
    results = _run_group(tmp_path, "--versions", "3", "--bucket-mb", "1", "--timeout-s", str(TIMEOUT_S),
                         sender_extra=["--kill-in", "2"])
    assert results[0][0] == -9, results[0][1][-3000:]
    big = int((tmp_path / "killed_in_bucket").read_text())
    for rank in (1, 2):
        code, output = results[rank]
        assert code == 3, f"rank {rank}:\n{output[-3000:]}"
        torn = json.loads((tmp_path / f"rank{rank}" / "torn.json").read_text())
        assert (torn["version"], torn["kept"], torn["loaded"]) == (2, 1, 1), torn
        assert "version 2 arrived torn and was refused" in torn["message"]
        assert "keeps version 1" in torn["message"]
        assert f"bucket {big} of" in torn["message"], torn["message"]  # its header or its transfer
        assert "the sender's process is gone" in torn["message"], torn["message"]
        # found by liveness: the wait ended before the transfer's own timeout could have ended it
        assert torn["seconds"] < TIMEOUT_S, torn
        assert not (tmp_path / f"rank{rank}" / "v2.safetensors").exists()
        _assert_bitwise(tmp_path / f"rank{rank}" / "kept.safetensors", 1)


def test_a_slow_sender_that_is_alive_is_waited_for(tmp_path):
    """The sender pauses between two buckets for longer than the group's timeout (the bound
    of one transfer, 4 s here): the receivers wait on its heartbeat, not on a deadline."""
    results = _run_group(tmp_path, "--versions", "2", "--timeout-s", "4", "--pause-s", "6")
    for rank, (code, output) in results.items():
        assert code == 0, f"rank {rank}:\n{output[-3000:]}"
    for rank in (1, 2):
        _assert_bitwise(tmp_path / f"rank{rank}" / "v2.safetensors", 2)
