"""One run of the harness, in its own process.

Each setting trains in a child process (``python -m portarl.bench.stability.worker
JOB.json``) so a native crash (SIGFPE in a kernel, the OOM killer) ends that run only: the
parent reads the exit status and reports it as the run's verdict instead of losing the
whole comparison. The child leaves ``run.json``, the trainer's logs and
``tokens.safetensors`` (per step, over the completion tokens in order: the trainer's old
log-probs, its entropy, and the rollout engine's log-probs) in its run directory.

``PORTARL_STABILITY_FAULT=label=SIGNAL@step`` makes that run's process raise the signal at
that step: the tests use it to show a native crash becomes that run's verdict.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from portarl.bench.stability.record import save_tokens, write_json
from portarl.bench.stability.runs import RunSpec


def _token_tap(trainer, tap, store: dict, trainer_label: str):
    """An ``old_logp`` hook: keeps this step's per-token old log-probs, and the entropy of
    the same forward pass (the trainer exposes no entropy hook, so it is recomputed here
    with the trainer's own log-prob path on the same batch and weights)."""
    from portarl.trainer.phases.sequences import build_batch, completion_logprobs

    cfg = trainer.config

    def entropy_of(part):  # the trainer's own log-prob path (same settings and numerics profile)
        return completion_logprobs(trainer.model, part, temperature=cfg.rollout.temperature,
                                   logits_policy=cfg.precision.logits, with_entropy=True, emulate=trainer.emulate)[1]

    def hook(step: int, old_logp: torch.Tensor) -> torch.Tensor:
        rollout = tap.batches[-1]
        batch = build_batch(rollout.prompt_ids, rollout.completion_ids, trainer.codec.pad_token_id, trainer.device,
                            vision=tap.media[-1])  # a vision-language model: the step's pixels and positions
        mb = cfg.train.micro_batch_size
        with torch.no_grad():
            entropy = torch.cat([entropy_of(batch.rows(slice(i, i + mb))) for i in range(0, batch.labels.shape[0], mb)])
        mask = batch.mask
        store[step] = {
            "old_logp": old_logp.detach()[mask].float().cpu(),
            "entropy": entropy.detach()[mask].float().cpu(),
            "rollout_logp": torch.tensor([v for lp in rollout.logprobs for v in lp], dtype=torch.float32),
        }
        fault = os.environ.get("PORTARL_STABILITY_FAULT", "")  # tests: "label=SIGNAL@step"
        if fault.partition("=")[0] == trainer_label and str(step) == fault.rpartition("@")[2]:
            os.kill(os.getpid(), getattr(signal, fault.partition("=")[2].partition("@")[0]))
        return old_logp

    return hook


def run_job(job: dict) -> int:
    from portarl.backends import envinfo
    from portarl.rollout import RecordingRollout, ReplayRollout
    from portarl.rollout.replay import file_sha256, load_rollouts
    from portarl.trainer import GRPOTrainer, TrainConfig, TrainingStopped, build_from_config

    spec = RunSpec.from_label(job["label"])
    sys.path[:0] = [d for d in job.get("code_dirs", []) if Path(d).is_dir()]  # the config's rewards (module:function)
    run_dir = Path(job["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    # train.old_logprobs=recompute: the token tap is an old_logp hook that reads the whole
    # batch's old log-probs at once, which only the scoring forward provides (auto takes
    # them per micro-batch from the training forward).
    overrides = [*job["overrides"], *spec.overrides(), f"output_dir={run_dir}", "train.old_logprobs=recompute",
                 "logging.progress=false", "logging.tensorboard=false", "logging.plot=false"]
    config = TrainConfig.load(job["config"], overrides)
    model, tokenizer, examples = build_from_config(config)
    trainer = GRPOTrainer(model, tokenizer, None, examples, config, device=config.device)
    info = {"label": spec.label, "steps": config.train.steps, "config": config.to_dict(),
            "environment": envinfo.environment(trainer.device), "stopped": None, "crashed": None}
    if job.get("replay"):
        tap = RecordingRollout(ReplayRollout(load_rollouts(job["replay"])[0]))
        info["rollouts"] = {"mode": "replayed", "sha256": file_sha256(job["replay"])}
    else:
        tap = RecordingRollout(trainer.rollout)
        info["rollouts"] = {"mode": "recording" if job.get("record") else "sampled"}
    trainer.rollout = tap
    tokens: dict = {}
    trainer.hooks["old_logp"].append(_token_tap(trainer, tap, tokens, spec.label))
    write_json(run_dir / "run.json", info)  # a crash below still leaves who and where
    # The run dir is the harness's own scratch: a rerun into the same --out replaces the
    # run files (overwrite clears only those, not run.json / stderr.log written above).
    try:
        trainer.train(overwrite=True)
    except TrainingStopped as err:
        info["stopped"] = str(err)
    finally:
        trainer.close()
        save_tokens(run_dir / "tokens.safetensors", tokens)
        if job.get("record"):
            info["rollouts"]["sha256"] = tap.save(job["record"], {"label": spec.label, "steps": config.train.steps})
        write_json(run_dir / "run.json", info)
    return 0


def launch(job: dict, job_path: Path) -> str | None:
    """Run ``job`` in a child process; None on success, else what ended it (for the verdict)."""
    run_dir = Path(job["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json(job_path, job)
    log = run_dir / "stderr.log"
    with log.open("w") as err:
        rc = subprocess.run([sys.executable, "-m", "portarl.bench.stability.worker", str(job_path)],
                            stdout=err, stderr=subprocess.STDOUT).returncode
    if rc == 0:
        job_path.unlink()
        return None
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        crashed = f"process killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")
    else:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        crashed = f"process exited {rc}: {lines[-1] if lines else 'no output'}"
    info_path = run_dir / "run.json"
    info = json.loads(info_path.read_text()) if info_path.exists() else {"label": job["label"], "environment": {}}
    info["crashed"] = crashed
    write_json(info_path, info)
    return crashed


if __name__ == "__main__":
    sys.exit(run_job(json.loads(Path(sys.argv[1]).read_text())))
