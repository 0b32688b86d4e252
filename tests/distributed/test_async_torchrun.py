"""rollout.mode=async under torchrun (issue 25), 2 Gloo ranks on the CPU: every rank takes
part in gathering the FSDP2 shards, rank 0 publishes them to one rollout worker, which
generates the whole step's batch, and every rank trains on its whole groups. Faults in the
worker stop every rank at the same step with one (collective) checkpoint, and a resumed
run regenerates the batches that were in flight."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to check the worker is gone")

from safetensors.torch import load_file, load_model  # noqa: E402

import run_guard  # noqa: E402
from portarl.trainer.checkpoint import CheckpointManager  # noqa: E402
from portarl.runtime.distributed import local_launcher
from proc_tree import alive  # noqa: E402
from test_fsdp_gloo import ATOL, PARAM_ATOL, RTOL, _env, _params_from, _rows, _train, assert_trained  # noqa: E402

HERE = Path(__file__).parent
WORKER = HERE / "rollout_weights_worker.py"
ASYNC = "rollout.mode=async"
MISMATCH = ("mismatch/abs_diff_mean", "mismatch/abs_diff_max")


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _worker_gone(stderr: str) -> bool:
    """The rollout worker named in the run's log (``rollout worker (pid N, ...)``) is gone."""
    pids = {int(p) for p in re.findall(r"rollout worker \(pid (\d+)", stderr)}
    assert pids, "the run never named its rollout worker"
    return not any(alive(pid) for pid in pids)


# ------------------------------------------------------------- the gathered weights
@pytest.fixture(scope="module")
def published(tmp_path_factory):
    root = tmp_path_factory.mktemp("published")
    one, two = root / "one", root / "two"
    one.mkdir(), two.mkdir()
    for cmd in ([sys.executable, str(WORKER), str(one)],
                [*local_launcher(2), str(WORKER), str(two)]):
        proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
    return one, two


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_gathered_shards_are_the_unsharded_weights(published, tied, dtype):
    from fsdp_linear_worker import tiny

    name = f"{'tied' if tied else 'untied'}-{dtype}.safetensors"
    one, two = (load_file(str(d / name)) for d in published)
    assert one.keys() == two.keys()
    for key in one:
        assert torch.equal(one[key], two[key]), key
        assert one[key].dtype == (torch.float32 if dtype == "fp32" else torch.bfloat16), key
    assert ("lm_head.weight" in one) != tied, "a tied head is written once (under the embedding's name)"
    reference = tiny(tied)
    expected = {k: v.to(one["model.embed_tokens.weight"].dtype) for k, v in reference.state_dict().items()}
    fresh = tiny(tied).to(expected["model.embed_tokens.weight"].dtype)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    load_model(fresh, str(published[1] / name), strict=True)  # what the rollout worker does
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, expected[key]), key


@pytest.mark.parametrize("tied", ["tied", "untied"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_gathered_lora_shards_are_one_process_merged_weights(published, tied, dtype):
    """model.lora: rank 0 publishes W + scaling * B @ A folded from the gathered shards,
    under the base model's names: one process's merged_state_dict of the same full
    weights, cast to the rollout dtype, bitwise."""
    pytest.importorskip("peft")
    from portarl.assets.lora import merged_state_dict
    from vllm_gather_worker import lora_model

    name = f"lora-{tied}-{dtype}.safetensors"
    one, two = (load_file(str(d / name)) for d in published)
    merged = merged_state_dict(lora_model(tied == "tied"))
    want = {k: v.to(torch.float32 if dtype == "fp32" else torch.bfloat16) for k, v in merged.items()
            if not (tied == "tied" and k == "lm_head.weight")}
    assert list(two) == list(one) and two.keys() == want.keys()
    assert not any("lora_" in k or "base_layer" in k for k in two)
    for key in want:
        assert torch.equal(one[key], want[key]) and torch.equal(two[key], want[key]), key
    base = tiny_state(tied == "tied")
    assert any(not torch.equal(want[k].float(), base[k]) for k in want), "the adapter must change the weights"


def tiny_state(tied: bool) -> dict:
    from fsdp_linear_worker import tiny

    return tiny(tied).state_dict()


@pytest.mark.parametrize("tied", ["tied", "untied"])
def test_lora_publish_gathers_one_layer_at_a_time_in_the_same_order_on_every_rank(published, tied):
    """Under FSDP2 each published tensor is gathered just before it is sent: a plain weight
    alone, an adapted one with its layer's lora_B and lora_A (folded whole, not from
    shards); rank 1 runs the very same gathers in the same order; a tied head is not
    gathered at all."""
    pytest.importorskip("peft")
    _, two = published
    ranks = [json.loads((two / f"lora-{tied}-gathers-rank{r}.json").read_text()) for r in (0, 1)]
    published_names = [name for name, _ in ranks[0][:-1]]
    assert sorted(published_names) == sorted(load_file(str(two / f"lora-{tied}-fp32.safetensors")))
    assert ranks[0][-1] == [None, []], "every gather comes before the tensor it belongs to"
    adapted = 0
    for name, gathered in ranks[0][:-1]:
        module, leaf = name.rsplit(".", 1)
        if not module.endswith(("q_proj", "v_proj", "up_proj")):
            assert gathered == [name], (name, gathered)
        elif leaf == "weight":
            adapted += 1
            assert gathered == [f"{module}.base_layer.weight", f"{module}.lora_B.default.weight",
                                f"{module}.lora_A.default.weight"], (name, gathered)
        else:  # an adapted layer's bias: its base layer's
            assert gathered == [f"{module}.base_layer.{leaf}"], (name, gathered)
    assert adapted == 6  # 3 adapted projections in each of the 2 layers
    assert ranks[1] == [[None, [g for _, gathered in ranks[0] for g in gathered]]]


# ------------------------------------------------------------------- whole runs
@pytest.fixture(scope="module")
def async_two(tmp_path_factory):
    out = tmp_path_factory.mktemp("async2")
    proc = _train(out, 2, "train.steps=3", ASYNC)
    return out, proc


def test_async_on_two_ranks_trains_with_staleness_wait_and_mismatch_metrics(async_two):
    out, proc = async_two
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert all(k in r for k in ("train/wait_s", "rollout/wait_s", "rollout/gen_s", *MISMATCH)), sorted(r)
        assert r["skipped"] == 0
    assert_trained(out)
    # max_staleness 1 (the default): the first batch waits for version 0, the next ones overlap
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 1]
    assert [r["rollout/version"] for r in rows] == [0, 0, 1]
    batches = _jsonl(out / "rollout_batches.jsonl")
    assert [(b["step"], b["version"]) for b in batches] == [(1, 0), (2, 0), (3, 1)]
    assert all(len(b["prompts"]) == 4 for b in batches), "one worker generates the whole step's prompts"
    latest = CheckpointManager(out).latest()
    assert CheckpointManager.is_sharded(latest) and CheckpointManager.load_state(latest)["step"] == 3
    assert not (out / "async_weights").exists()
    assert _worker_gone(proc.stderr)


@pytest.mark.compares_runs
def test_one_async_step_on_two_ranks_matches_one_process(tmp_path):
    """Step 1 is sampled by version 0 on both (the 2-rank one gathered from the shards):
    the same completions, hence the same rewards exactly; the update then agrees to the
    reduction-order tolerance of tests/distributed/test_fsdp_gloo.py."""
    single, double = tmp_path / "single", tmp_path / "double"
    for out, ranks in ((single, 1), (double, 2)):
        # unshared rows: shared-prompt rows are composed per rank (see test_fsdp_gloo.py)
        proc = _train(out, ranks, "train.steps=1", ASYNC, "rollout.max_staleness=0", "train.share_prompt=false")
        assert proc.returncode == 0, proc.stderr[-4000:]
    assert_trained(single, double)
    a, b = _rows(single)[0], _rows(double)[0]
    assert a["reward/mean"] == b["reward/mean"] and a["reward/std"] == b["reward/std"]
    assert _jsonl(single / "rollout_batches.jsonl") == _jsonl(double / "rollout_batches.jsonl")
    for key in ("loss", "pg/loss", "kl/loss", "grad_norm"):
        assert b[key] == pytest.approx(a[key], rel=RTOL, abs=ATOL), key
    pa = _params_from(CheckpointManager(single).latest())
    pb = _params_from(CheckpointManager(double).latest())
    for key in pa:
        torch.testing.assert_close(pb[key], pa[key], rtol=0, atol=PARAM_ATOL, msg=key)


def test_a_dying_worker_stops_both_ranks_with_one_checkpoint_and_resume_regenerates(tmp_path):
    proc = _train(tmp_path, 2, "train.steps=3", ASYNC, "checkpoint.every=1000",
                  env=_env(PORTARL_ROLLOUT_WORKER_FAULT="die@2"))
    assert proc.returncode != 0, proc.stderr[-4000:]
    stopped = [e for e in _jsonl(tmp_path / "events.jsonl") if e.get("kind") == "stopped"]
    assert stopped and "rollout worker (pid" in stopped[0]["message"] and "exited with code 3" in stopped[0]["message"]
    assert [r["step"] for r in _rows(tmp_path)] == [1]
    latest = CheckpointManager(tmp_path).latest()
    assert CheckpointManager.is_sharded(latest) and CheckpointManager.load_state(latest)["step"] == 1
    assert _worker_gone(proc.stderr)
    # The batch of step 2 was in flight (requested at step 1): the resumed run generates it anew.
    proc = _train(tmp_path, 2, "train.steps=3", ASYNC, resume=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["step"] for r in _rows(tmp_path)] == [1, 2, 3]
    batches = _jsonl(tmp_path / "rollout_batches.jsonl")
    assert [b["step"] for b in batches] == [1, 2, 3], "a batch lost or trained twice"
    assert _worker_gone(proc.stderr)


def test_a_reward_failing_in_the_worker_stops_both_ranks_naming_it(tmp_path):
    proc = _train(tmp_path, 2, "train.steps=3", ASYNC, "checkpoint.every=1000",
                  "rewards=[{name: 'dist_rewards:fails_in_the_second_batch'}]")
    assert proc.returncode != 0, proc.stderr[-4000:]
    assert proc.stderr.count("the grader is down") >= 2, proc.stderr[-4000:]  # both ranks name it
    assert "in the rollout worker" in proc.stderr
    assert [r["step"] for r in _rows(tmp_path)] == [1]
    latest = CheckpointManager(tmp_path).latest()
    assert CheckpointManager.is_sharded(latest) and CheckpointManager.load_state(latest)["step"] == 1
    assert _worker_gone(proc.stderr)


def _limit_file_size():
    """Files of at most 60 kB (the published weights of the tiny model are 86 kB; the run's
    logs and the worker's spec stay below); a write past it fails with EFBIG."""
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # ignored dispositions survive exec
    resource.setrlimit(resource.RLIMIT_FSIZE, (60_000, 60_000))


def test_a_weights_file_that_cannot_be_written_stops_every_rank_with_the_same_line(tmp_path):
    """rollout.weight_sync=file: rank 0 cannot write the published weights (a file-size
    limit, as a full disk); every rank ends with the one line of a failed write naming the
    file (exit 4), none waits on for a batch that is not coming."""
    from test_fsdp_gloo import FAST

    cmd = [*local_launcher(2), "-m", "portarl", "train", "--device",
           "cpu", "--output-dir", str(tmp_path)]
    for item in (*FAST, "train.steps=2", ASYNC, "rollout.weight_sync=file"):
        cmd += ["--set", item]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600, preexec_fn=_limit_file_size)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("portarl train: cannot write")]
    assert len(lines) == 2 and len(set(lines)) == 1, proc.stderr[-4000:]  # rank 0's and rank 1's, alike
    assert lines[0].startswith(f"portarl train: cannot write {tmp_path}/async_weights/weights-slot0.tmp: File too "
                               "large (EFBIG); there is no checkpoint yet"), lines[0]
    assert "failed (exitcode: 4)" in proc.stderr, proc.stderr[-4000:]  # (torchrun's own report follows)
    assert not (tmp_path / "async_weights").exists()  # the pipeline closed: its worker stopped


@pytest.mark.compares_runs
def test_two_workers_under_torchrun_share_the_steps_and_hold_the_trainers_weights_bitwise(tmp_path):
    """rollout.num_workers=2 under 2-rank torchrun, collective weight sync: rank 0 starts
    both workers, worker (s - 1) mod 2 generates the whole batch of step s, and every
    version each worker loaded is the one the ranks trained (the sharded checkpoint of that
    step, gathered), bitwise."""
    from portarl.rollout.async_worker import DUMP_ENV

    out, dumps = tmp_path / "run", tmp_path / "dumps"
    dumps.mkdir()
    proc = _train(out, 2, "train.steps=4", ASYNC, "rollout.num_workers=2", "rollout.weight_sync=collective",
                  "rollout.sync_bucket_mb=0.01", "checkpoint.keep_last=10", env=_env(**{DUMP_ENV: str(dumps)}))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["step"] for r in _rows(out)] == [1, 2, 3, 4]
    batches = _jsonl(out / "rollout_batches.jsonl")
    assert [(b["step"], b["worker"], b["version"]) for b in batches] == [(1, 0, 0), (2, 1, 0), (3, 0, 1), (4, 1, 2)]
    assert all(len(b["prompts"]) == 4 for b in batches), "each worker generates its steps' whole batches"
    checkpoints = {CheckpointManager.load_state(d)["step"]: d for d in CheckpointManager(out).complete()}
    grad_norms, start = run_guard.grad_norms(out), run_guard.start_weights(out)
    for prefix in ("", "w1-"):
        loaded = sorted(int(p.stem.split("v")[-1]) for p in dumps.glob(f"{prefix}v*.safetensors"))
        reported = {b["version"] for b in batches if b["worker"] == (1 if prefix else 0)}
        assert reported <= set(loaded), (prefix, reported, loaded)
        assert [v for v in loaded if v > 0], f"worker {prefix or 'w0'} loaded no trained version: {loaded}"
        for version in loaded:
            worker = load_file(str(dumps / f"{prefix}v{version}.safetensors"))
            if version == 0:  # the initial weights: both workers hold the same
                want = load_file(str(dumps / "v0.safetensors"))
            else:  # a version trained: the weights synced moved from the start (the guard)
                want = _params_from(checkpoints[version])
                run_guard.assert_trained(grad_norms[:version], start, worker,
                                         what=f"worker {prefix or 'w0'}'s version {version}")
            assert worker.keys() == want.keys()
            differ = [k for k in want if not torch.equal(worker[k], want[k])]
            assert not differ, f"worker {prefix or 'w0'}, version {version}: {differ[:3]} differ from the trainer's"
    assert (out / "rollout_worker-1.log").exists()
    assert "arrived whole" in (out / "rollout_worker-1.log").read_text()
    assert _worker_gone(proc.stderr)


def test_a_send_cut_midway_stops_every_rank_at_the_same_step_with_a_checkpoint(tmp_path):
    """Rank 0 stops sending version 2 after 1 of its buckets (fault injection), while rank 1
    is still gathering the rest of that version's shards with it (publishing is a stream of
    collective gathers): rank 0 runs the remaining gathers before it reports, so both ranks
    reach the step's end, stop there with one sharded checkpoint, and the worker never
    loaded the torn version."""
    from portarl.rollout.async_worker import DUMP_ENV
    from portarl.trainer.asynchronous.sync import FAULT_ENV

    dumps = tmp_path / "dumps"
    dumps.mkdir()
    proc = _train(tmp_path / "run", 2, "train.steps=4", ASYNC, "rollout.weight_sync=collective",
                  "rollout.sync_bucket_mb=0.01", "checkpoint.every=1",
                  env=_env(**{FAULT_ENV: "stop@2:1", DUMP_ENV: str(dumps)}))
    assert proc.returncode != 0 and "exitcode  : 3" in proc.stderr, proc.stderr[-4000:]  # the ranks' code: 3
    assert proc.stderr.count("weights version 2 could not be sent whole") >= 2, proc.stderr[-4000:]  # both ranks
    loaded = sorted(int(p.stem[1:]) for p in dumps.glob("v*.safetensors"))
    assert loaded and max(loaded) <= 1, loaded
    latest = CheckpointManager(tmp_path / "run").latest()
    assert CheckpointManager.is_sharded(latest) and CheckpointManager.load_state(latest)["step"] == 2
    assert _worker_gone(proc.stderr)


# ------------------------------------------------------------------- LoRA, async
def _merged_from(directory: Path | None) -> dict[str, torch.Tensor]:
    """The merged weights (portarl.assets.lora.merged_state_dict, one process) of a LoRA run's
    checkpoint (sharded or not); ``None``: the initial adapter's (B = 0: the base)."""
    from portarl.assets.lora import load_adapter, merged_state_dict
    from test_torchrun_options import _lora_model

    model = _lora_model()
    if directory is not None and CheckpointManager.is_sharded(directory):
        CheckpointManager.load_sharded(directory, model, torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad]))
    elif directory is not None:
        load_adapter(model, directory)
    return {k: v.detach().clone() for k, v in merged_state_dict(model).items()}


@pytest.mark.compares_runs
@pytest.mark.parametrize("sync", ["collective", "file"])
def test_lora_async_on_two_ranks_publishes_the_merged_weights_of_every_version_bitwise(tmp_path, sync):
    """model.lora under 2-rank torchrun, async: rank 0 publishes W + scaling * B @ A, each
    adapted weight folded from the gathered base weight and adapter, and every version the
    worker loaded is what one process's merged_state_dict gives from that step's sharded
    checkpoint, bitwise, under the base model's names."""
    pytest.importorskip("peft")
    from portarl.rollout.async_worker import DUMP_ENV
    from test_torchrun_options import LORA

    out, dumps = tmp_path / "run", tmp_path / "dumps"
    dumps.mkdir()
    proc = _train(out, 2, "train.steps=3", ASYNC, *LORA, f"rollout.weight_sync={sync}", "optim.lr=5e-2",
                  "checkpoint.keep_last=10", env=_env(**{DUMP_ENV: str(dumps)}))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["step"] for r in _rows(out)] == [1, 2, 3]
    checkpoints = {CheckpointManager.load_state(d)["step"]: d for d in CheckpointManager(out).complete()}
    assert all(CheckpointManager.is_sharded(d) for d in checkpoints.values())
    loaded = sorted(int(p.stem[1:]) for p in dumps.glob("v*.safetensors"))
    batches = _jsonl(out / "rollout_batches.jsonl")
    assert {b["version"] for b in batches} <= set(loaded) and [v for v in loaded if v > 0], loaded
    start, grad_norms = _merged_from(None), run_guard.grad_norms(out)
    for version in loaded:
        worker = load_file(str(dumps / f"v{version}.safetensors"))
        want = _merged_from(checkpoints[version]) if version else start
        assert worker.keys() == want.keys() and not any("lora_" in k or "base_layer" in k for k in worker)
        differ = [k for k in want if not torch.equal(worker[k], want[k])]
        assert not differ, f"version {version}: {differ[:3]} differ from the trainer's merged weights"
        if version:  # the check can fail: the trained adapter moved the merged weights (the guard)
            run_guard.assert_trained(grad_norms[:version], start, worker, what=f"the worker's version {version}")
    assert _worker_gone(proc.stderr)


@pytest.mark.compares_runs
def test_lora_async_on_two_ranks_matches_one_process(tmp_path):
    """The same LoRA async run (2 steps, staleness 0, unshared rows) on 1 process and on 2
    ranks: step 1 (version 0) samples the same completions and updates the adapter alike
    (tolerances of test_fsdp_gloo.py); step 2 is sampled by version 1, merged on one
    process and folded from the gathered shards on two: the same completions again, and the
    same step."""
    pytest.importorskip("peft")
    from test_fsdp_gloo import assert_params_close
    from test_torchrun_options import LORA, _adapter, _lora_model

    single, double = tmp_path / "single", tmp_path / "double"
    for out, ranks in ((single, 1), (double, 2)):
        proc = _train(out, ranks, "train.steps=2", ASYNC, *LORA, "rollout.max_staleness=0", "train.share_prompt=false",
                      "checkpoint.keep_last=10")
        assert proc.returncode == 0, proc.stderr[-4000:]
    assert _jsonl(single / "rollout_batches.jsonl") == _jsonl(double / "rollout_batches.jsonl")
    assert [b["version"] for b in _jsonl(double / "rollout_batches.jsonl")] == [0, 1]
    for a, b in zip(_rows(single), _rows(double), strict=True):
        assert a["reward/mean"] == b["reward/mean"] and a["reward/std"] == b["reward/std"], a["step"]
        for key in ("loss", "pg/loss", "kl/loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=RTOL, abs=ATOL), (a["step"], key)
    first = [next(d for d in CheckpointManager(out).complete() if CheckpointManager.load_state(d)["step"] == 1)
             for out in (single, double)]
    for out, checkpoint in zip((single, double), first):  # the step-1 adapters compared moved (the guard)
        run_guard.assert_trained(run_guard.grad_norms(out)[:1], run_guard.start_weights(checkpoint),
                                 run_guard.checkpoint_weights(checkpoint), what=f"the {out.name} run's step 1")
    one, two = _lora_model(), _lora_model()
    from portarl.assets.lora import load_adapter

    load_adapter(one, first[0])
    assert CheckpointManager.is_sharded(first[1])
    CheckpointManager.load_sharded(first[1], two, torch.optim.AdamW([p for p in two.parameters() if p.requires_grad]))
    assert_params_close(_adapter(one), _adapter(two))


@pytest.mark.compares_runs
def test_partial_rollouts_on_two_ranks_match_one_process(tmp_path):
    """``rollout.partial`` under torchrun (issue 60): rank 0's worker keeps the pool, every
    rank trains on its whole groups of each batch the pool completes. With benchmark lengths
    (a heavy tail) and max_staleness 2 groups are carried across steps and versions; the batches (which prompts,
    asked for at which step, from which version) are the same for 2 ranks and 1 process, and
    the update agrees to the reduction-order tolerance."""
    from portarl.rollout.bench_lengths import ENV

    single, double = tmp_path / "single", tmp_path / "double"
    for out, ranks in ((single, 1), (double, 2)):
        proc = _train(out, ranks, "train.steps=3", ASYNC, "rollout.partial=true", "rollout.max_new_tokens=24",
                      "rollout.max_staleness=2", "train.share_prompt=false", env=_env(**{ENV: "tail:2:24"}))
        assert proc.returncode == 0, proc.stderr[-4000:]
    assert_trained(single, double)
    batches = _jsonl(single / "rollout_batches.jsonl")
    assert batches == _jsonl(double / "rollout_batches.jsonl")
    assert any(asked != b["step"] for b in batches for asked in b["asked_at"]), "no group was carried"
    for a, b in zip(_rows(single), _rows(double)):
        assert a["reward/mean"] == b["reward/mean"] and b["rollout/token_staleness_max"] <= 2
    a, b = _rows(single)[0], _rows(double)[0]
    for key in ("loss", "pg/loss", "grad_norm"):
        assert b[key] == pytest.approx(a[key], rel=RTOL, abs=ATOL), key
