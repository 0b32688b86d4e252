"""What torchrun used to refuse, now run for real: LoRA (FSDP2 over the peft model, the
optimizer over the adapter only), the SFT warm-up, and fp16 with its loss scale, each on 2
Gloo ranks against 1 process on the same global batch (tolerances of test_fsdp_gloo.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from test_fsdp_gloo import (  # noqa: E402
    _env,
    _params_from,
    _rows,
    _train,
    assert_params_close,
    assert_same_step,
)

from portarl.trainer.checkpoint import CheckpointManager  # noqa: E402

LORA = ["model.lora.r=4", "model.lora.target_modules=[q_proj, v_proj, up_proj]"]


def _one_and_two(root, *sets):
    single, double = root / "single", root / "double"
    for out, ranks in ((single, 1), (double, 2)):
        proc = _train(out, ranks, "train.steps=1", *sets)
        assert proc.returncode == 0, proc.stderr[-4000:]
    return single, double


def _lora_model():
    from portarl.assets.lora import apply_lora
    from portarl.assets.models import build_tiny
    from portarl.trainer.config.lora import lora_section

    model, _ = build_tiny(hidden_size=32, intermediate_size=64)
    section = lora_section({"r": 4, "target_modules": ["q_proj", "v_proj", "up_proj"]})
    return apply_lora(model, section, seed=0)


def _adapter(model) -> dict:
    return {k: v.detach().clone() for k, v in model.named_parameters() if "lora_" in k}


@pytest.mark.compares_runs
def test_lora_on_two_ranks_matches_one_process(tmp_path):
    pytest.importorskip("peft")
    from portarl.assets.lora import load_adapter

    single, double = _one_and_two(tmp_path, *LORA)
    assert_same_step(single, double)
    one = _lora_model()
    load_adapter(one, CheckpointManager(single).latest())
    two = _lora_model()
    latest = CheckpointManager(double).latest()
    assert CheckpointManager.is_sharded(latest)
    CheckpointManager.load_sharded(latest, two, torch.optim.AdamW([p for p in two.parameters() if p.requires_grad]))
    assert_params_close(_adapter(one), _adapter(two))
    # the base weights are untouched, and the optimizer state is the adapter's alone
    base = {k: v for k, v in two.named_parameters() if "lora_" not in k}
    start = dict(_lora_model().named_parameters())
    assert all(torch.equal(v, start[k]) for k, v in base.items())
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(latest / "dcp")).read_metadata()
    optim_keys = [k for k in meta.state_dict_metadata if k.startswith("optim.state.")]
    assert optim_keys and all("lora_" in k for k in optim_keys), optim_keys[:5]


@pytest.mark.compares_runs
def test_sft_warmup_on_two_ranks_matches_one_process(tmp_path):
    """One warm-up step of 8 examples (4 per rank), then one GRPO step anchored (KL) to the
    warmed-up model: the same rollouts, loss and parameters as one process. PARAM_ATOL bounds
    one AdamW step at lr 1e-2 (reduction-order noise amplified up to 1e-3 of the step); the
    warm-up's own step runs at lr 1e-3, so its share of that noise stays 10x under it."""
    single, double = _one_and_two(tmp_path, "train.sft_warmup_steps=1", "train.sft_batch_size=8",
                                  "train.sft_lr=1e-3")
    assert_same_step(single, double)
    assert_params_close(_params_from(CheckpointManager(single).latest()),
                        _params_from(CheckpointManager(double).latest()))


def test_sft_batch_that_does_not_split_over_the_ranks_is_refused(tmp_path):
    proc = _train(tmp_path, 2, "train.steps=1", "train.sft_warmup_steps=1", "train.sft_batch_size=3")
    assert proc.returncode != 0
    assert "train.sft_batch_size=3 must be a multiple of the 2 ranks" in proc.stderr, proc.stderr[-3000:]


def test_fp16_overflow_on_one_rank_skips_the_step_on_both(tmp_path):
    """fp16 under FSDP2 with the dynamic loss scale: an inf in one rank's gradient shard at
    step 1 is an overflow for both ranks (the decision reads the global norm): both skip the
    step and halve the scale, and step 2 trains."""
    env = _env(PORTARL_FAULT_INJECT="grad@1@1")
    proc = _train(tmp_path, 2, "train.steps=2", "precision.dtype=fp16", env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = _rows(tmp_path)
    assert rows[0]["precision/overflow"] == 1.0 and rows[0]["precision/loss_scale"] == 2.0**15, rows[0]
    assert rows[1].get("precision/overflow", 0.0) == 0.0 and rows[1]["grad_norm"] > 0, rows[1]
    state = CheckpointManager.load_state(CheckpointManager(tmp_path).latest())
    assert state["precision"]["scale"] == 2.0**15


@pytest.mark.compares_runs
def test_fp16_on_two_ranks_matches_one_process(tmp_path):
    """fp16 with the dynamic loss scale: one process steps fp32 masters of fp16 weights,
    two ranks step FSDP2's fp32 parameters computing in fp16; the same first step, and the
    masters after it equal the 2-rank parameters."""
    single, double = _one_and_two(tmp_path, "precision.dtype=fp16")
    assert_same_step(single, double)
    state = CheckpointManager.load_state(CheckpointManager(single).latest())
    names = [n for n, p in _tiny().named_parameters() if p.requires_grad]
    masters = dict(zip(names, state["precision"]["masters"]))
    assert_params_close({k: masters[k] for k in names}, {k: v for k, v in _params_from(
        CheckpointManager(double).latest()).items() if k in masters})


def _tiny():
    from portarl.assets.models import build_tiny

    return build_tiny(hidden_size=32, intermediate_size=64)[0]


def _teacher(root):
    from portarl.assets.models import build_tiny

    model, tok = build_tiny(seed=7, hidden_size=32, intermediate_size=64)
    model.save_pretrained(root / "teacher")
    tok.save_pretrained(root / "teacher")
    return root / "teacher"


@pytest.mark.compares_runs
def test_distillation_on_two_ranks_matches_one_process(tmp_path):
    """loss.distill (issue 61): every rank loads the teacher and scores its own rows; the step
    (reverse KL beside the rewards' advantages) agrees with one process's."""
    teacher = _teacher(tmp_path)
    single, double = _one_and_two(tmp_path, f"loss.distill={{teacher: {teacher}, coef: 0.5}}",
                                  "rollout.lean_decode=false", "train.share_prompt=false")
    assert_same_step(single, double, keys=("loss", "pg/loss", "grad_norm", "distill/reverse_kl"))


def test_ppo_with_a_value_model_on_two_ranks(tmp_path):
    """loss.advantage_estimator=gae under torchrun (issue 61): the value model sharded with
    FSDP2 beside the policy, its values and GAE whitened over both ranks' tokens, its state
    gathered into the checkpoint and loaded back by a resumed run."""
    out = tmp_path / "ppo"
    proc = _train(out, 2, "train.steps=2", "loss.advantage_estimator=gae", "critic.warmup_steps=1",
                  "critic.lr=1e-3")
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["critic/warmup"] == 1.0
    assert all(r["value/grad_norm"] > 0 for r in rows) and rows[1]["grad_norm"] > 0
    state = CheckpointManager.load_state(CheckpointManager(out).latest())
    assert state["critic"]["model"] and state["critic"]["optimizer"]
    proc = _train(out, 2, "train.steps=3", "loss.advantage_estimator=gae", "critic.warmup_steps=1",
                  "critic.lr=1e-3", resume=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["step"] for r in _rows(out)] == [1, 2, 3]
