"""Stability harness pieces that need no training: the rollout file format (no pickle),
run specs with overrides, replay refusals, honest verdicts, token-level divergence."""

from __future__ import annotations

import io
import pickle
import zipfile

import pytest
import torch

from portarl.bench.stability.analysis import analyse, first_divergence, off_policy, token_divergence
from portarl.bench.stability.record import ReplayMismatch, RunResult, check_replay
from portarl.bench.stability.runs import RunSpec, parse_runs
from portarl.rollout.base import RolloutBatch
from portarl.rollout.replay import ReplayRollout, RolloutFileError, load_rollouts, save_rollouts


# ---- rollout file ----
def _batches():
    return [RolloutBatch([[1, 2, 3], [1, 2, 3]], [[4, 5], []], [[-0.1234567890123, -2.5], []], [True, False]),
            RolloutBatch([[7]], [[8, 9, 10]], [[-1e-9, -3.0, -0.5]], [False])]


def test_rollouts_round_trip_exactly(tmp_path):
    path = tmp_path / "r.safetensors"
    sha = save_rollouts(_batches(), path, {"label": "cpu:fp32"})
    batches, meta = load_rollouts(path)
    assert [b.__dict__ for b in batches] == [b.__dict__ for b in _batches()]  # float64: Python floats exact
    assert meta == {"label": "cpu:fp32"} and len(sha) == 64
    assert ReplayRollout.load(path).batches[1].completion_ids == [[8, 9, 10]]


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))  # unpickling would create the marker file


def test_planted_pickle_is_refused_without_running_code(tmp_path):
    marker = tmp_path / "code-ran"
    raw = tmp_path / "raw.safetensors"
    raw.write_bytes(pickle.dumps([_RunsCode(marker)]))
    torch_style = tmp_path / "torch-style.safetensors"  # torch.save layout: a zip holding data.pkl
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps([_RunsCode(marker)]))
    torch_style.write_bytes(buf.getvalue())
    for path in (raw, torch_style):
        with pytest.raises(RolloutFileError, match="never unpickles"):
            load_rollouts(path)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(RolloutFileError, match="not a portarl rollout recording"):
        load_rollouts(garbage)
    assert not marker.exists()
    pickle.loads(raw.read_bytes())  # the planted file really would have run code
    assert marker.exists()


# ---- run specs ----
def test_run_spec_overrides():
    spec = parse_runs("cpu:bf16@optim.lr=1e-5@loss.clip_eps_high=0.2, cpu:fp32")[0]
    assert spec.settings == ("optim.lr=1e-5", "loss.clip_eps_high=0.2")
    assert spec.overrides()[-2:] == ["optim.lr=1e-5", "loss.clip_eps_high=0.2"]
    assert spec.label == "cpu:bf16@optim.lr=1e-5@loss.clip_eps_high=0.2"
    assert RunSpec.from_label(spec.label) == spec and RunSpec.from_label(spec.as_noise().label) == spec.as_noise()
    assert "/" not in spec.slug and ":" not in spec.slug
    for bad, why in (("cpu:bf16@lr", "section.field=value"), ("cpu:bf16@precision.dtype=fp32", "set by the run spec"),
                     ("cpu:bf16,cpu:bf16", "twice")):
        with pytest.raises(ValueError, match=why):
            parse_runs(bad)


# ---- replay refusals ----
def _config(**changes):
    cfg = {"device": "cpu", "output_dir": "a", "model": {"path": "m", "init_seed": 0},
           "data": {"path": None, "synthetic_size": 64}, "train": {"seed": 0, "steps": 5, "prompts_per_step": 4},
           "rollout": {"group_size": 4, "max_new_tokens": 3}, "optim": {"lr": 1e-3},
           "precision": {"dtype": "fp32"}}
    for key, value in changes.items():
        section, field = key.split("__")
        cfg[section][field] = value
    return cfg


@pytest.mark.parametrize("change, category", [
    ({"train__seed": 1}, "seeds mismatch: train.seed: recorded 0, here 1"),
    ({"data__synthetic_size": 32}, "data order mismatch: data.synthetic_size"),
    ({"train__prompts_per_step": 2}, "data order mismatch: train.prompts_per_step"),
    ({"rollout__group_size": 2}, "prompts mismatch: rollout.group_size"),
    ({"optim__lr": 1e-5}, "config mismatch: optim.lr"),
])
def test_replay_refuses_and_names_the_mismatch(change, category):
    with pytest.raises(ReplayMismatch, match=category.replace("(", r"\(").replace(".", r"\.")):
        check_replay(_config(), _config(**change), [], 5, 5, "gpu/")


def test_replay_allows_the_setting_under_test():
    here = _config(precision__dtype="bf16", optim__lr=1e-5, train__steps=3)
    here["device"], here["output_dir"] = "npu", "b"
    check_replay(_config(), here, ["optim.lr=1e-5"], 5, 3, "gpu/")  # device, dtype, @ override, fewer steps
    with pytest.raises(ReplayMismatch, match="steps mismatch: 6 steps asked, 5 recorded"):
        check_replay(_config(), _config(), [], 5, 6, "gpu/")


# ---- verdicts ----
def _run(label, kl, skipped=(), steps=None, tokens=None, sha=None, grad=None):
    rows = []
    for i, v in enumerate(kl, start=1):
        row = {"step": i, "kl": v, "reward/mean": 0.5, "grad_norm": (grad or {}).get(i, 1.0), "skipped": int(i in skipped)}
        if i in skipped:
            row.update(kl=float("nan"), grad_norm=float("nan"), **{"guard/nonfinite_tensor": "old_logp"})
        rows.append(row)
    spec = RunSpec.from_label(label)
    return RunResult(spec, rows, [], None, "CPU", steps=steps or len(kl), tokens=tokens or {},
                     rollouts={"mode": "replayed", "sha256": sha} if sha else {})


def test_skipped_steps_count_as_diverged_and_are_named():
    base = _run("cpu:fp32", [0.10] * 30)
    fp16 = _run("cpu:fp16", [0.10] * 30, skipped=range(2, 31))
    assert first_divergence(base, fp16, "kl", 0.1) == (2, "skipped")
    verdict = analyse([base, fp16], 0.1)["runs"][1]["verdict"]
    assert "PARTS from cpu:fp32 at step 2 (skipped" in verdict
    assert "skipped (non-finite) steps 2-30 (29 of 30" in verdict and "old_logp" in verdict
    short = _run("cpu:bf16", [0.10] * 10, steps=30)  # stopped / crashed after 10 of 30 steps
    assert first_divergence(base, short, "kl", 0.1) == (11, "missing")


def test_parting_is_judged_against_the_measured_noise_floor():
    kl = [0.10, 0.12, 0.09, 0.11, 0.10, 0.13, 0.10, 0.12]
    base = _run("cpu:fp32", kl)
    six = _run("cpu:bf16", [v * 1.06 for v in kl])  # 6% apart
    noise = _run("cpu:fp32", [v * 0.92 for v in kl]).__class__(**{**_run("cpu:fp32", [v * 0.92 for v in kl]).__dict__,
                                                                  "spec": RunSpec.from_label("cpu:fp32#noise")})
    assert analyse([base, six], 0.05)["parted"] == ["cpu:bf16"]  # no floor: 6% > 5% parts
    with_floor = analyse([base, six, noise], 0.05)
    assert with_floor["parted"] == [] and "within its measured noise floor" in with_floor["runs"][1]["verdict"]
    far = _run("cpu:bf16", [v * 1.5 for v in kl])
    assert analyse([base, far, noise], 0.05)["parted"] == ["cpu:bf16"]


def _pg_run(label, pg, adv_abs_max=1.5):
    rows = [{"step": i, "pg/loss": v, "adv/adv_abs_max": adv_abs_max, "kl": 0.1, "reward/mean": 0.5,
             "grad_norm": 1.0, "entropy": 2.0, "skipped": 0} for i, v in enumerate(pg, start=1)]
    return RunResult(RunSpec.from_label(label), rows, [], None, "CPU", steps=len(pg))


@pytest.mark.parametrize("baseline", [0.0, 1e-9], ids=["identically-0", "1e-9"])
def test_a_zero_typical_size_cannot_beat_the_threshold(baseline):
    """A baseline metric at (or near) 0 has no usable scale: the threshold applies to the
    rounding floor, so a huge threshold never parts, and last-bit noise never parts."""
    base = _pg_run("cpu:fp32", [baseline] * 3)
    fp32_noise = _pg_run("cpu:fp32", [baseline, baseline + 3e-8, baseline - 2e-8])  # last-bit gaps
    bf16 = _pg_run("cpu:bf16", [baseline, 4e-3, -3e-3])  # bf16 ratios: ~u_bf16 x |A|
    for run in (fp32_noise, bf16):
        assert first_divergence(base, run, "pg/loss", 1e9) is None
        assert analyse([base, run], 1e9)["parted"] == []
    assert first_divergence(base, fp32_noise, "pg/loss", 0.1) is None  # below 2 u_fp32 x 1.5
    assert first_divergence(base, bf16, "pg/loss", 0.1) is None  # below 2 u_bf16 x 1.5 = 1.2e-2
    entry = analyse([base, bf16], 0.1)["runs"][1]
    assert entry["limits"]["pg/loss"]["usable_scale"] is False
    assert entry["limits"]["pg/loss"]["rounding_floor"] == pytest.approx(2 * 2.0 ** -8 * 1.5)
    assert "no usable scale in the baseline for pg/loss" in entry["verdict"]
    real = _pg_run("cpu:bf16", [baseline, 0.5, 0.4])  # a real parting, far beyond rounding
    assert first_divergence(base, real, "pg/loss", 0.1) == (2, "pg/loss")
    assert first_divergence(base, real, "pg/loss", 1e9) is None  # ... unless the user asked for 1e9x


def test_huge_threshold_never_parts_on_finite_runs():
    base = _run("cpu:fp32", [0.10, 0.11, 0.0, 0.0])
    wild = _run("cpu:bf16", [5.0, -3.0, 1e3, 2.0], grad={1: 40.0, 2: 1e-9})
    result = analyse([base, wild], 1e9)
    assert result["parted"] == [] and "1e+09x" in result["runs"][1]["verdict"]


# ---- token level ----
def _tokens(logp, rollout=None):
    t = torch.tensor(logp, dtype=torch.float32)
    return {"old_logp": t, "entropy": torch.ones_like(t),
            "rollout_logp": torch.tensor(rollout if rollout is not None else logp, dtype=torch.float32)}


def test_token_divergence_on_identical_tokens():
    logp = [-2.0123, -0.5077, -3.2611, -1.0331]  # not bf16-representable: rounding them costs ~1e-3
    base = _run("cpu:fp32", [0.1] * 3, sha="s", tokens={s: _tokens(logp) for s in (1, 2, 3)})
    same = _run("cpu:bf16", [0.1] * 3, sha="s", tokens={s: _tokens(logp) for s in (1, 2, 3)})
    drift = {1: _tokens(logp), 2: _tokens([v + 1e-4 for v in logp]), 3: _tokens([v + 0.1 for v in logp])}
    moved = _run("npu:bf16", [0.1] * 3, sha="s", tokens=drift, grad={3: 1.5})
    assert all(t["max_abs_dlogp"] == 0 and t["k3_kl"] == 0 for t in token_divergence(base, same))
    rows = token_divergence(base, moved)
    assert rows[2]["max_abs_dlogp"] == pytest.approx(0.1, rel=1e-5) and rows[2]["k3_kl"] > 0
    assert rows[2]["grad_norm_diff"] == pytest.approx(0.5)
    result = analyse([base, same, moved], 0.1)
    entry = next(r for r in result["runs"] if r["label"] == "npu:bf16")
    assert entry["tokens"]["first_above_bf16"] == 3  # 1e-4 is below bf16 rounding of |logp| ~ 2; 0.1 is not
    assert token_divergence(base, _run("x:fp32", [0.1], sha="other", tokens={1: _tokens(logp)})) is None


def test_off_policy_step_of_a_replaying_run():
    logp = [-2.0, -1.0]
    tokens = {1: _tokens(logp, [-2.001, -1.0]), 2: _tokens(logp, [-2.002, -1.0]), 3: _tokens(logp, [-2.3, -1.2])}
    series, far = off_policy(_run("npu:bf16", [0.1] * 3, sha="s", tokens=tokens))
    assert far == 3 and len(series) == 3


def test_compare_refuses_a_directory_that_is_not_a_run(tmp_path, capsys):
    from portarl.cli import main

    assert main(["bench", "stability", "compare", str(tmp_path), "--out", str(tmp_path / "r")]) == 2
    assert "is not a stability run directory (no manifest.json)" in capsys.readouterr().err
