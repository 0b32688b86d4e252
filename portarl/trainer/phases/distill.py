"""On-policy distillation (``loss.distill``): the student samples, a frozen teacher scores
each sampled token, and the per-token reverse KL to the teacher is a dense advantage.

Per completion token t sampled by the student: kl_t = logp_student(t) - logp_teacher(t)
("k1", the sampled reverse KL's estimate: tinker-cookbook's ``reverse_kl``, slime's
``--use-opd``) or exp(-d) + d - 1 with d = that difference ("k3": never negative, lower
variance, Schulman's estimator); the token's advantage gets ``- coef * kl_t``, on top of
the rewards' advantage (``rewards: true``) or alone. logp_student is the behaviour policy's
(the old log-probs when the trainer recomputes them, else the engine's own): the sample's
KL as it was drawn. The teacher's come from :func:`portarl.ops.linear_logprobs` on its
hidden states and head (never N x V logits), under ``torch.no_grad``.

The teacher is loaded once (:func:`load_teacher`; any causal LM directory, a ``.gguf``
file or a built-in model), in the run's compute dtype on every rank's device (under
torchrun each rank holds a whole copy: it is only ever run forward), never trained and not
in checkpoints. Its tokenizer must be the student's: the same vocabulary (every token's
id) and the same special tokens; otherwise the run is refused at start in one line. In
async mode the teacher runs in the trainer (its scoring phase), not in the worker: the
worker holds only the policy's copy and the rewards, and the teacher's forward is a
scoring forward like the reference model's.
"""

from __future__ import annotations

import torch

from portarl.trainer.config import ConfigError


def _vocabulary(tokenizer) -> tuple:
    from portarl.assets.tokenizer import CharTokenizer

    if isinstance(tokenizer, CharTokenizer):
        return ("chars", tokenizer.chars)
    vocab = tokenizer.get_vocab()
    specials = tuple(sorted((str(k), str(v)) for k, v in getattr(tokenizer, "special_tokens_map", {}).items()))
    return ("vocab", tuple(sorted(vocab.items())), specials)


def tokenizer_mismatch(student, teacher) -> str | None:
    """Why the two tokenizers do not tokenize alike, or None."""
    a, b = _vocabulary(student), _vocabulary(teacher)
    if a == b:
        return None
    if a[0] != b[0]:
        return f"the student's tokenizer is {type(student).__name__}, the teacher's {type(teacher).__name__}"
    if a[0] == "chars":
        return f"the character alphabets differ ({len(a[1])} vs {len(b[1])} characters)"
    if a[1] != b[1]:
        return f"the vocabularies differ ({len(a[1])} vs {len(b[1])} tokens, or the same tokens with other ids)"
    return f"the special tokens differ ({dict(a[2])} vs {dict(b[2])})"


def load_teacher(trainer):
    """The frozen teacher of ``loss.distill.teacher`` on the trainer's device, in the run's
    dtype; refuses a tokenizer other than the student's."""
    import dataclasses

    from portarl.assets.models import build_model
    from portarl.trainer.guards.precision import DTYPES

    cfg = trainer.config
    path = cfg.loss.distill["teacher"]
    dtype = DTYPES[cfg.precision.dtype]
    try:
        teacher, tokenizer = build_model(dataclasses.replace(cfg.model, path=path, lora=None), dtype)
    except (OSError, ValueError, FileNotFoundError) as err:
        raise ConfigError(f"loss.distill.teacher {path}: cannot be loaded ({err})") from None
    why = tokenizer_mismatch(trainer.tokenizer, tokenizer)
    if why is not None:
        raise ConfigError(f"loss.distill.teacher {path}: its tokenizer is not the student's ({why}); on-policy "
                          "distillation scores the student's sampled tokens with the teacher, so both must tokenize "
                          "alike")
    teacher = teacher.to(trainer.device, dtype=dtype).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


def reverse_kl(student_logp: torch.Tensor, teacher_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per token: k1 = s - t, or k3 = exp(-(s - t)) + (s - t) - 1 (>= 0)."""
    d = student_logp - teacher_logp
    return d if estimator == "k1" else torch.exp(-d) + d - 1.0


def distill_advantages(trainer, batch, advantages: torch.Tensor, old_logp, rollout_logp, teacher_logp,
                       metrics: dict) -> torch.Tensor:
    """[B, T] advantages: ``advantages`` (per sequence or per token; 0 with ``rewards: false``)
    minus ``coef`` times each token's reverse KL to the teacher (``teacher_logp``: the
    teacher's log-probs of the batch, from the scoring phase's no-grad forward); adds
    ``distill/*`` metrics."""
    options = trainer.config.loss.distill
    student = old_logp if old_logp is not None else rollout_logp
    mask = batch.mask.bool()
    kl = torch.where(mask, reverse_kl(student.float(), teacher_logp.float(), options["estimator"]), 0.0)
    base = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(kl)
    if not options["rewards"]:
        base = torch.zeros_like(kl)
    n = mask.sum().clamp(min=1)
    metrics["distill/reverse_kl"] = float(kl.sum() / n)
    metrics["distill/teacher_logp"] = float(torch.where(mask, teacher_logp, 0.0).sum() / n)
    return (base - options["coef"] * kl) * mask


__all__ = ["distill_advantages", "load_teacher", "reverse_kl", "tokenizer_mismatch"]
