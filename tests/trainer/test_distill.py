"""On-policy distillation (``loss.distill``, issue 61): the teacher's per-token reverse KL
against a float64 reference on a full-logits forward of both models, the advantage it
makes (with and without the rewards'), the teacher frozen and out of checkpoints, a
mismatched tokenizer refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

import run_guard
from portarl.assets.models import build_tiny
from portarl.cli import main
from portarl.parity.errors import assert_close
from portarl.parity.tolerances import fp32_result
from portarl.trainer.phases.distill import distill_advantages, reverse_kl
from portarl.trainer.phases.scoring import no_grad_logprobs
from portarl.trainer.phases.sequences import build_batch
from trainer_fast import varied_reward

SIZES = dict(hidden_size=32, intermediate_size=64)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """Another tiny model (another seed) with the student's character tokenizer."""
    out = tmp_path_factory.mktemp("teacher")
    model, tok = build_tiny(seed=7, **SIZES)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _float64_logp(model, batch) -> torch.Tensor:
    """log p of each completion token from a full-logits forward in float64."""
    m = model.double()
    with torch.no_grad():
        logits = m(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   position_ids=batch.position_ids).logits
    width = batch.labels.shape[1]
    logp = torch.log_softmax(logits[:, -width - 1:-1], -1)
    return logp.gather(-1, batch.labels.clamp(min=0)[..., None]).squeeze(-1) * batch.mask


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_the_reverse_kl_per_token_is_the_float64_one_of_both_models(make_trainer, teacher_dir, estimator):
    trainer = make_trainer(f"loss.distill={{teacher: {teacher_dir}, estimator: {estimator}, rewards: false, coef: 0.5}}")
    prompts = [trainer.encoded_prompt(ex) for ex in trainer.examples[:3] for _ in range(2)]
    completions = [[5 + (i * 11 + j) % 60 for j in range(2 + i % 4)] for i in range(len(prompts))]
    batch = build_batch(prompts, completions, trainer.codec.pad_token_id, "cpu")
    student = _float64_logp(build_tiny(seed=0, **SIZES)[0], batch)  # the student as built (init_seed 0)
    teacher = _float64_logp(build_tiny(seed=7, **SIZES)[0], batch)
    metrics = {}
    teacher_logp = no_grad_logprobs(trainer, trainer.teacher, batch)  # the scoring phase's forward
    got = distill_advantages(trainer, batch, torch.zeros(len(prompts)), student.float(), None, teacher_logp, metrics)
    want = -0.5 * reverse_kl(student, teacher, estimator) * batch.mask
    scale = float(torch.cat([student, teacher]).abs().max())
    assert_close(got, want, fp32_result(scale), f"distill advantages {estimator}")
    n = batch.mask.sum()
    assert metrics["distill/reverse_kl"] == pytest.approx(float((reverse_kl(student, teacher, estimator)
                                                                 * batch.mask).sum() / n), abs=1e-5)
    with_rewards = make_trainer(f"loss.distill={{teacher: {teacher_dir}, estimator: {estimator}, coef: 0.5}}")
    task = torch.arange(len(prompts), dtype=torch.float32)
    both = distill_advantages(with_rewards, batch, task, student.float(), None,
                              no_grad_logprobs(with_rewards, with_rewards.teacher, batch), {})
    assert_close(both - task[:, None] * batch.mask, want, fp32_result(scale + len(prompts)), "rewards beside")


@pytest.mark.compares_runs
def test_a_distilled_run_trains_the_student_and_never_the_teacher(make_trainer, teacher_dir):
    trainer = make_trainer(f"loss.distill={{teacher: {teacher_dir}}}", "train.steps=2", "checkpoint.every=1",
                           rewards=[varied_reward])
    teacher_start = {k: v.clone() for k, v in trainer.teacher.state_dict().items()}
    trainer.train()
    run_guard.assert_run_trained(trainer.output_dir, what="the distilled student")
    assert all(torch.equal(v, teacher_start[k]) for k, v in trainer.teacher.state_dict().items())
    assert not any(p.requires_grad for p in trainer.teacher.parameters())
    rows = [json.loads(line) for line in (trainer.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["distill/reverse_kl"] != 0 for r in rows)
    names = {p.name for p in (trainer.output_dir / "checkpoints" / "step-000002").iterdir()}
    assert not any("teacher" in n for n in names)  # the teacher is loaded from its path, never saved


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line(tmp_path, capsys):
    code = main(["train", "--output-dir", str(tmp_path / "r"), "--set", "train.steps=1",
                 "--set", "loss.distill={teacher: tiny-chat}"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("portarl train: loss.distill.teacher tiny-chat: its tokenizer is not "
                                                "the student's"), err
