"""Reference sync (TRL's sync_ref_model / ref_model_mixup_alpha / ref_model_sync_steps):
the mix formula, its cadence in training, its survival across a resume, and the refusals."""

from __future__ import annotations

import pytest
import torch

from portarl.parity.errors import assert_close
from portarl.parity.tolerances import fp32_result
from portarl.trainer.config import ConfigError
from portarl.trainer.phases.reference import mix_into_reference

import run_guard
from trainer_fast import fast_config, varied_reward

SYNC = ("loss.kl_coef=0.1", "reference.sync=true", "reference.sync_steps=2", "reference.mixup_alpha=0.25")


def test_mix_is_tr_dpo_formula():
    torch.manual_seed(0)
    policy, ref = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    expected = {n: 0.25 * p.detach().double() + 0.75 * r.detach().double()
                for (n, p), r in zip(policy.named_parameters(), ref.parameters())}
    mix_into_reference(ref, policy, 0.25)
    for name, r in ref.named_parameters():
        assert_close(r, expected[name], fp32_result(1.0), name)


def _params(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def test_reference_follows_the_policy_every_sync_steps(make_trainer):
    trainer = make_trainer(*SYNC, rewards=[varied_reward])
    m1 = trainer.train_step()
    initial = _params(trainer.ref_model)  # made at step 1 from the start weights; not synced yet
    assert m1["reference/synced"] == 0
    m2 = trainer.train_step()
    assert m2["reference/synced"] == 1
    policy = _params(trainer.model)
    for name, r in trainer.ref_model.named_parameters():
        expected = 0.25 * policy[name].double() + 0.75 * initial[name].double()
        assert_close(r, expected, fp32_result(float(expected.abs().max())), name)
    assert any((r.detach() != initial[n]).any() for n, r in trainer.ref_model.named_parameters())
    m3 = trainer.train_step()
    assert m3["reference/synced"] == 0


@pytest.mark.compares_runs
def test_synced_reference_survives_resume(make_trainer, tmp_path):
    trainer = make_trainer(*SYNC, "checkpoint.every=1", rewards=[varied_reward])
    start = _params(trainer.model)
    norms = [trainer.train_step()["grad_norm"] for _ in range(2)]
    trainer.save_checkpoint()
    synced = _params(trainer.ref_model)
    # the reference compared moved from the start weights (a fresh trainer's own reference is those)
    run_guard.assert_trained(norms, start, synced, what="the reference synced at step 2")
    again = make_trainer(*SYNC, "checkpoint.every=1", rewards=[varied_reward])
    assert again.resume() == 2
    for name, r in again.ref_model.named_parameters():
        assert torch.equal(r.detach(), synced[name]), name


def test_refusals(tmp_path):
    with pytest.raises(ConfigError, match="reference.sync with LoRA"):
        fast_config(tmp_path, *SYNC, "model.lora.r=4")
    with pytest.raises(ConfigError, match="loss.kl_coef"):
        fast_config(tmp_path, "reference.sync=true", "loss.kl_coef=0")
    with pytest.raises(ConfigError, match="reference.mixup_alpha"):
        fast_config(tmp_path, *SYNC[:2], "reference.mixup_alpha=1.5")


def test_resume_of_a_run_saved_before_these_sections_existed(tmp_path):
    """A config.yaml without the shaping / reference / eval sections (an older run) resumes
    when they hold their defaults; a non-default value is still a refused change."""
    import yaml

    from portarl.trainer.run.output_dir import RunDirError, check_resume_config

    cfg = fast_config(tmp_path)
    saved = cfg.to_dict()
    for section in ("shaping", "reference", "eval"):
        saved.pop(section)
    saved["rollout"].pop("dynamic_sampling")
    out = tmp_path / "old"
    out.mkdir()
    (out / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    assert check_resume_config(out, cfg) == []
    with pytest.raises(RunDirError, match="shaping.overlong_buffer"):
        check_resume_config(out, fast_config(tmp_path, "shaping.overlong_buffer=1"))
