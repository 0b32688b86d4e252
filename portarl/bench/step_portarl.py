"""The portarl sides of ``portarl bench step``: GRPOTrainer on the work, colocated or async.

``portarl`` (colocated, the default rollout mode): each step generates, scores and updates
in this process, with ``threads`` threads. ``portarl-async`` (``rollout.mode: async``,
``--async``): the rollout worker process generates and scores the next batch while this
one trains (one step of staleness, the default), each process with ``threads // 2``
threads, so the side uses the cores the others do; only with ``--model`` (the worker builds
its model from the path, then loads the trainer's weights). Both take the same config (see
:mod:`portarl.bench.step`), the work's reward by name (:data:`portarl.bench.step_work.REWARDS`,
as the worker loads it) and the same prompts.

Steps are timed from the driver's go to the end of ``train_step``; phases by wrapping from
outside (no trainer edits): rollout (colocated: ``rollout.generate``; async: the whole
rollout phase, i.e. publishing the weights and waiting for the worker's batch), scoring
(``scoring.score``), update (the rest). Per step also the reward per sample
(``reward/mean``) and, for async, the worker's process CPU time since its previous batch
(``rollout/cpu_s``): the side's ``cpu_s`` is the trainer's plus the worker's.
"""

from __future__ import annotations

import contextlib
import tempfile
import time

from portarl.bench import step_work
from portarl.bench.step_side import finish, gate, set_threads, step_record, timed
from portarl.bench.step_work import REWARDS, Work


def config_overrides(tmp: str, steps: int, work: Work, mode: str) -> list[str]:
    """The side's TrainConfig (``mode``: ``colocated`` or ``async``)."""
    out = [
        f"output_dir={tmp}", "device=cpu", "precision.dtype=fp32", f"train.steps={steps}",
        f"train.prompts_per_step={work.prompts_per_step}", f"rollout.group_size={work.group_size}",
        f"rollout.max_new_tokens={work.max_new_tokens}", f"rollout.temperature={work.temperature}",
        "train.sft_warmup_steps=0", f"train.micro_batch_size={work.micro_batch_size}", "train.ppo_epochs=1",
        f"optim.lr={work.lr}", f"train.gradient_checkpointing={str(work.gradient_checkpointing).lower()}",
        f"loss.kl_coef={work.beta}", "logging.progress=false", "logging.tensorboard=false", "logging.plot=false",
        "checkpoint.every=1000000", f"rewards=[{{name: '{REWARDS[work.reward][0]}'}}]", f"rollout.mode={mode}",
    ]
    if mode == "async":  # the worker builds the model from its path (the weights then come from the trainer)
        out.append(f"model.path={work.model}")
    return out


def run_portarl(steps: int, threads: int, work: Work, mode: str = "colocated") -> dict:
    started = time.perf_counter()
    asynchronous = mode == "async"
    set_threads(max(1, threads // 2) if asynchronous else threads)
    from portarl.assets.data import Example
    from portarl.trainer import GRPOTrainer, TrainConfig
    from portarl.trainer.asynchronous.pipeline import async_rollout

    policy, tok = step_work.load(work)
    baseline = step_work.rss_mib()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig.load(None, config_overrides(tmp, steps, work, mode))
        data = [Example(p, a) for p, a in step_work.prompts(work, work.prompts_per_step * (steps + 2))]
        trainer = GRPOTrainer(policy, tok, None, data, cfg, device="cpu")
        del policy
        if trainer.uses_reference():
            trainer.ref_model = trainer.make_reference()
        phases: dict = {}
        import portarl.trainer.phases.iteration as grpo_module

        if asynchronous:  # the engine is the worker's: building one here would start a second
            grpo_module.run_rollout = timed(phases, "rollout", grpo_module.run_rollout)
        else:
            engine = trainer.rollout
            engine.generate = timed(phases, "rollout", engine.generate)
        grpo_module.score = timed(phases, "scoring", grpo_module.score)
        records = []
        with async_rollout(trainer) if asynchronous else contextlib.nullcontext():
            for _ in range(steps):
                gate()
                phases.clear()
                t0, w0, c0 = time.time(), time.perf_counter(), time.process_time()
                metrics = trainer.train_step()
                record = step_record(time.perf_counter() - w0, time.process_time() - c0, dict(phases), t0)
                record["reward_mean"] = metrics["reward/mean"]
                if asynchronous:
                    record["trainer_cpu_s"], record["worker_cpu_s"] = record["cpu_s"], metrics["rollout/cpu_s"]
                    record["cpu_s"] += metrics["rollout/cpu_s"]
                records.append(record)
    return finish(records, threads, started, baseline, trainer.model)


__all__ = ["config_overrides", "run_portarl"]
