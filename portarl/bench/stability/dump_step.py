"""``portarl bench stability dump``: one recorded GRPO step's forward and backward, dumped
per module on this machine.

From a stability directory that recorded its rollouts (``bench stability
--replay-rollouts``; or one that replayed them, ``--replay-from``, which points back to its
recording): the shared start model, config and seeds, then steps 1..S-1 trained here on
the recorded rollouts (the updates of the steps before S, replayed with this machine's
numerics), then step S's recorded rollouts scored as the trainer scores them (rewards,
old / reference log-probs, advantages) and the first micro-batch of its first optimizer
step run forward and backward under :func:`portarl.bench.stability.dump.dump_modules`,
with portarl's own ops recorded: ``portarl.logprobs`` and ``portarl.entropy`` (inputs: the
decoder's last hidden states and the output embedding), ``portarl.kl`` (the per-token KL
to the reference, computed as the loss computes it) and ``portarl.loss``. No optimizer
step is taken at S.

Activation checkpointing is off in the dump (``train.gradient_checkpointing=false``, also for
the replayed updates, whose numbers it does not change): a checkpointed layer runs its
forward again in the backward, and the dump would record every such layer twice (a
``(call 1)`` row per recomputed module); a dump records one forward per module.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Callable

from portarl.bench.stability.archive import is_archive
from portarl.bench.stability.record import CONFIG, ROLLOUTS, START_MODEL, load_run, read_manifest
from portarl.bench.stability.runs import check_run_devices, parse_runs


def _source(directory: Path) -> tuple[Path, dict, str]:
    """``(recording directory, its manifest, default run label)``."""
    manifest = read_manifest(directory)
    if manifest.get("replayed_from"):
        label = manifest["runs"][0]["label"]
        source = Path(manifest["replayed_from"])
        if is_archive(source):
            raise FileNotFoundError(f"{directory} replayed the archive {source}: pass it to --from itself, with "
                                    f"--run {label}")
        if not source.exists():
            raise FileNotFoundError(f"{directory} replayed {source}, which is not here: pass the recording directory "
                                    "itself to --from")
        return source, read_manifest(source), label
    if not manifest.get("recording") or not (directory / ROLLOUTS).exists():
        raise FileNotFoundError(f"{directory} holds no recorded rollouts: record with portarl bench stability "
                                "--replay-rollouts")
    return directory, manifest, manifest["recording"]["label"]


def grpo_step_fn(trainer, old_logp, ref_logp, rollout_logp, advantages, norms: dict) -> Callable:
    """The trainer's loss on one micro-batch (``update.optimizer_step``), with its ops tapped."""
    from portarl.core import compute_loss
    from portarl.core.kl import kl_per_token
    from portarl.trainer.phases.scoring import logprobs

    loss_cfg = trainer.loss_config()

    def step(model, part, tap):
        seen: dict = {}
        handle = model.get_decoder().register_forward_hook(
            lambda _m, _a, out: seen.__setitem__("hidden", getattr(out, "last_hidden_state", None)))
        try:
            logp, entropy = logprobs(trainer, model, part, with_entropy=True)
        finally:
            handle.remove()
        head = model.get_output_embeddings().weight
        tap.record("portarl.logprobs", logp, inputs=(seen.get("hidden"), head))
        tap.record("portarl.entropy", entropy, inputs=(seen.get("hidden"), head))
        old = logp.detach() if old_logp is None else old_logp
        if ref_logp is not None and loss_cfg.kl_coef > 0:
            kl = kl_per_token(logp, ref_logp, part.mask, estimator=loss_cfg.kl_estimator)[0]
            tap.record("portarl.kl", kl, inputs=(logp, ref_logp))
        loss, _ = compute_loss(logp, old, advantages, part.mask, config=loss_cfg, ref_logp=ref_logp,
                               rollout_logp=rollout_logp, entropy=entropy, **norms)
        return tap.record("portarl.loss", loss, inputs=(logp, old, advantages))

    return step


def dump_recorded_step(directory: str | Path, step: int, out: str | Path, *, run: str | None = None,
                       modules=None, budget_mb: float = 1024.0, rows: int | None = None,
                       progress: Callable[[str], None] | None = None) -> Path:
    """Dump step ``step`` of the recording in ``directory`` under setting ``run`` (a
    ``--runs`` entry, default: the directory's own run). Returns the index path."""
    from portarl.backends import envinfo
    from portarl.bench.stability.dump import dump_modules
    from portarl.rollout import ReplayRollout
    from portarl.rollout.replay import load_rollouts
    from portarl.trainer import GRPOTrainer, TrainConfig, build_from_config
    from portarl.trainer.phases.rollout import run_rollout
    from portarl.trainer.phases.scoring import score
    from portarl.trainer.phases.update import mini_batch_rows

    source, manifest, label = _source(Path(directory).resolve())
    batches = load_rollouts(source / ROLLOUTS)[0]
    if not 1 <= step <= len(batches):
        raise ValueError(f"--step {step}: {source} recorded steps 1..{len(batches)}")
    if rows is not None and rows < 1:
        raise ValueError(f"--rows {rows}: give a positive number of sequences")
    spec = parse_runs(run)[0] if run else parse_runs(label.removesuffix("#noise"))[0]
    check_run_devices([spec], "--run")  # npu:bf16 on a machine without torch_npu: refused here, not mid-replay
    recorder = load_run(source / "runs" / manifest["recording"]["slug"])
    import sys

    # The recording config's rewards (module:function) where that directory exists on this machine.
    sys.path[:0] = [d for d in manifest.get("code_dirs", []) if Path(d).is_dir() and d not in sys.path]
    with tempfile.TemporaryDirectory(prefix="portarl-dump-") as scratch:
        overrides = [f"model.path={source / START_MODEL}", f"train.steps={step}", f"train.seed={manifest['seed']}",
                     *spec.overrides(), f"output_dir={scratch}", "train.old_logprobs=recompute",
                     "train.gradient_checkpointing=false", "logging.progress=false", "logging.tensorboard=false", "logging.plot=false"]
        config = TrainConfig.load(source / CONFIG, overrides)
        model, tokenizer, examples = build_from_config(config)
        trainer = GRPOTrainer(model, tokenizer, None, examples, config, device=config.device)
        trainer.rollout = ReplayRollout(batches)
        try:
            for s in range(1, step):
                if progress:
                    progress(f"replaying update {s}/{step - 1} ({spec.label})")
                trainer.train_step()
            trainer.hook_step = step
            phase = run_rollout(trainer, step)
            trainer.guard.reset()
            scored = score(trainer, phase, {})
            cfg = trainer.config.train
            picked = mini_batch_rows(scored.batch.labels.shape[0], cfg.mini_batches, cfg.seed, step, 0)[0]
            mini = scored.batch.rows(picked)
            mask = mini.mask.bool()
            norms = {"num_global_tokens": int(mask.sum()), "num_global_seqs": int(mask.any(dim=-1).sum())}
            take = slice(0, rows or cfg.micro_batch_size)

            def cut(t):
                return None if t is None else t[picked][take]

            part = mini.rows(take)
            step_fn = grpo_step_fn(trainer, cut(scored.old_logp), cut(scored.ref_logp), cut(scored.rollout_logp),
                                   cut(scored.advantages), norms)
            if progress:
                progress(f"dumping step {step}: {part.labels.shape[0]} sequences, forward and backward")
            extra = {"label": spec.label, "source": str(source), "dtype": config.precision.dtype,
                     "numerics": config.precision.numerics, "emulation": sorted(trainer.emulate),
                     "emulated": spec.emulated, "sequences": int(part.labels.shape[0]),
                     "recorded_by": recorder.spec.label, "config": json.loads(json.dumps(config.to_dict(), default=str))}
            return dump_modules(trainer.model, part, out, step_fn=step_fn, modules=modules, budget_mb=budget_mb,
                                step=step, rank=0, environment=envinfo.environment(trainer.device), extra=extra)
        finally:
            trainer.close()
