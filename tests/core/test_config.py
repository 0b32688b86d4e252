"""GRPOConfig: documented defaults, validation that names the field, dict round trip."""

from __future__ import annotations

import subprocess
import sys

import pytest

from portarl.core import GRPOConfig


def test_defaults():
    cfg = GRPOConfig()
    assert (cfg.advantage_estimator, cfg.policy_loss, cfg.clip_eps_low, cfg.clip_eps_high) == ("grpo", "ppo_clip", 0.2, 0.28)
    assert (cfg.dual_clip, cfg.kl_coef, cfg.kl_estimator, cfg.loss_agg_mode) == (3.0, 0.0, "k3", "token-mean")
    assert (cfg.gspo_eps_low, cfg.gspo_eps_high, cfg.mismatch_mode, cfg.mismatch_truncate_c) == (3e-4, 4e-4, "token_truncate", 2.0)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("policy_loss", "ppo", "GRPOConfig.policy_loss='ppo' is not one of"),
        ("loss_agg_mode", "mean", "GRPOConfig.loss_agg_mode='mean'"),
        ("clip_eps_low", 1.0, "GRPOConfig.clip_eps_low must be < 1"),
        ("clip_eps_high", -0.1, "GRPOConfig.clip_eps_high must be > 0"),
        ("dual_clip", 1.0, "GRPOConfig.dual_clip must be > 1"),
        ("kl_coef", -1.0, "GRPOConfig.kl_coef must be >= 0"),
        ("kl_estimator", "k4", "GRPOConfig.kl_estimator='k4'"),
        ("mismatch_mode", "tis", "GRPOConfig.mismatch_mode='tis'"),
        ("advantage_scale", "std", "GRPOConfig.advantage_scale='std'"),
        ("entropy_coef", float("nan"), "GRPOConfig.entropy_coef must be a number"),
    ],
)
def test_validation_names_the_field(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        GRPOConfig(**{field: value})


def test_dr_grpo_needs_max_length():
    with pytest.raises(ValueError, match="needs max_response_length"):
        GRPOConfig(loss_agg_mode="seq-mean-token-sum-norm")
    assert GRPOConfig(loss_agg_mode="seq-mean-token-sum-norm", max_response_length=512).max_response_length == 512


def test_from_dict_rejects_unknown_keys():
    cfg = GRPOConfig.from_dict({"kl_coef": 0.01, "policy_loss": "gspo"})
    assert cfg.kl_coef == 0.01 and GRPOConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown GRPOConfig field\\(s\\): clip_ratio"):
        GRPOConfig.from_dict({"clip_ratio": 0.2})


def test_core_runs_without_triton_or_torch_npu():
    code = (
        "import sys\n"
        "sys.modules['triton'] = None\n"
        "sys.modules['torch_npu'] = None\n"
        "import torch\n"
        "from portarl.core import GRPOConfig, compute_advantages, compute_loss\n"
        "adv = compute_advantages(torch.tensor([1.0, 0.0]), 2).advantages\n"
        "lp = torch.full((2, 3), -1.0, requires_grad=True)\n"
        "loss, m = compute_loss(lp, lp.detach() - 0.1, adv, torch.ones(2, 3), config=GRPOConfig(kl_coef=0.1),\n"
        "                       ref_logp=lp.detach() - 0.2)\n"
        "loss.backward()\n"
        "assert 'triton' not in {k for k, v in sys.modules.items() if v is not None}\n"
        "print('ok', float(loss))\n"
    )
    env_free = {"PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env_free, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stderr
