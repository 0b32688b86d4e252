"""``portarl train`` and ``portarl sft``: their shared arguments and their shared checks.

Why one module: every mistake a new user makes (a missing extra, a bad ``--steps``, a YAML
syntax error, a bad ``--set`` value, an output directory that is a file or holds another
run, a model directory without weights or tokenizer files, an absent device, bad data)
must end the same way for both commands: one line on stderr naming the problem, exit 2,
no traceback, and before any training starts. :func:`prepare` does all of it once, for
both commands, instead of a copy per command.

Nothing here imports torch or transformers at module level: ``portarl --help`` stays fast.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from portarl.runtime import blackbox
from portarl.cli.config import UsageError, check_model_dir, load_config, log, require_train_extra

#: ``portarl train --help`` / ``portarl sft --help``: each command's own description.
DESCRIPTIONS = {
    "train": "GRPO training. With no --config: the built-in tiny Qwen2 with a character tokenizer on synthetic "
             "arithmetic (a short supervised warm-up first). Writes metrics.jsonl, events.jsonl, TensorBoard logs, "
             "curves.png and checkpoints under --output-dir (default runs/train); Ctrl-C saves a checkpoint and "
             "--resume continues from it.",
    "sft": "Supervised fine-tuning on (prompt, answer) data: cross-entropy on the answer tokens only. Saves a "
           "Hugging Face model directory to <output-dir>/sft-model (LoRA adapters merged in), ready for "
           "`portarl train --set model.path=<output-dir>/sft-model`.",
}


def add_run_arguments(p, command: str) -> None:
    """The arguments ``train`` and ``sft`` share (and those only one of them has)."""
    p.add_argument("--config", help="YAML config (sections: model, data, rollout, rewards, train, optim, ...)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a field, e.g. train.steps=10")
    p.add_argument("--device", help="auto, cuda, npu or cpu (overrides the config)")
    if command == "train":
        p.add_argument("--output-dir", help="where metrics, TensorBoard logs and checkpoints go (default runs/train)")
        p.add_argument("--overwrite", action="store_true",
                       help="the output directory holds an earlier run: delete that run's files first")
    else:
        p.add_argument("--output-dir", help="the model is saved to <output-dir>/sft-model (default runs/train)")
        p.add_argument("--overwrite", action="store_true", help="replace an existing <output-dir>/sft-model")
    if command == "train":
        p.add_argument("--steps", type=int, help="GRPO steps (overrides train.steps)")
        p.add_argument("--resume", action="store_true",
                       help="continue from the latest complete checkpoint (steps, lr, logging and checkpoint "
                            "settings may change; other changes are refused); refused when there is none")
        p.add_argument("--resume-or-start", action="store_true",
                       help="--resume when the output directory has a checkpoint, else start a new run (for a job "
                            "script that a scheduler may run again)")
    else:
        p.add_argument("--steps", type=int, help="SFT steps (default: train.sft_warmup_steps, or 100 when that is 0)")


@dataclasses.dataclass
class Prepared:
    config: object
    device: object
    model: object
    tokenizer: object
    examples: list
    locked: bool = False  # this process took the output directory's run lock (released by the caller)


def prepare(args, command: str) -> Prepared:
    """Every check both commands need, in the order a user would fix them, then the model,
    tokenizer and data. Raises :class:`UsageError` with a one-line message."""
    require_train_extra(command)
    config = load_config(args, command)
    blackbox.note(output_dir=config.output_dir)  # named by a supervising parent (portarl/runtime/supervisor.py)
    if command == "train":  # logging.trackers: a tracker's package missing, before the model loads
        from portarl.trainer.run.trackers import missing_extra, swanlab_local_refusal

        if (line := missing_extra(config.logging.active_trackers()) or swanlab_local_refusal(config)) is not None:
            raise UsageError(line)
    if config.model.lora is not None:
        from portarl.assets.lora import LoraUnavailable, require_peft

        try:
            require_peft()
        except LoraUnavailable as err:
            raise UsageError(str(err)) from None
    locked = claim_output_dir(args, command, config)
    try:
        return _build(command, config, locked)
    except BaseException:
        if locked:
            from portarl.trainer.run import lock as run_lock

            run_lock.release(config.output_dir)
        raise


def claim_output_dir(args, command: str, config) -> bool:
    """Check, create and (``train``, rank 0) lock the output directory, then the checks that
    read it; returns whether this call took the lock (:mod:`portarl.trainer.run.lock`),
    taken before anything in the directory is read or deleted."""
    from portarl.trainer.run import lock as run_lock
    from portarl.trainer.checkpoint import CheckpointManager
    from portarl.trainer.run.output_dir import RunDirError, check_output_dir, check_resume_config, create_output_dir, no_checkpoint

    locked = False
    try:
        if command == "train":
            resume = args.resume or args.resume_or_start
            if args.resume and not args.resume_or_start and not Path(config.output_dir).exists():
                raise no_checkpoint(config.output_dir)  # before a mistyped directory is created
            if not Path(config.output_dir).is_file():  # (a file: refused just below)
                create_output_dir(config.output_dir)
                if run_lock.is_lock_holder():
                    run_lock.acquire(config.output_dir)
                    locked = True
            # After the lock: a live run is named by it, not taken for a finished one.
            check_output_dir(config.output_dir, resume=resume, overwrite=args.overwrite)
            if args.resume and not args.resume_or_start and not CheckpointManager(config.output_dir).complete():
                raise no_checkpoint(config.output_dir)
            if resume:  # refused changes before the model is built (the trainer checks again)
                check_resume_config(config.output_dir, config)
        else:
            check_output_dir(config.output_dir)  # a file is refused; an earlier run there is fine
            create_output_dir(config.output_dir)
            sft_out = Path(config.output_dir) / "sft-model"
            if sft_out.exists() and not args.overwrite:
                raise UsageError(f"{sft_out} already exists: pass --overwrite to replace it, or choose another "
                                 "--output-dir")
    except RunDirError as err:
        if locked:
            run_lock.release(config.output_dir)
        raise UsageError(str(err)) from None
    return locked


def _build(command: str, config, locked: bool) -> Prepared:
    """The device, data, model and tokenizer (after every check of the output directory).
    The data loads first: ``train`` checks the user's tools, environments and rewards
    against its columns (:mod:`portarl.trainer.start.preflight`) before the model loads."""
    from portarl.backends.device import DeviceUnavailableError, resolve_device
    from portarl.trainer.start import preflight

    try:
        device = resolve_device(config.device)
        if command == "train":
            preflight.check_worker_devices(config)
    except (DeviceUnavailableError, ValueError) as err:
        raise UsageError(str(err)) from None
    check_model_dir(config.model.path)
    if command == "train" and config.rollout.engine == "vllm":
        from portarl.rollout.vllm import vllm_unavailable_reason

        reason = vllm_unavailable_reason()
        if reason is not None:
            raise UsageError(f"rollout.engine=vllm: {reason}")
    from portarl.trainer.run.progress import quiet_third_party

    quiet_third_party()
    from portarl.trainer.start.build import build_examples, build_policy

    try:
        examples = build_examples(config)
        if command == "train":
            preflight.check_user_code(config, examples)
        model, tokenizer = build_policy(config)
    except (ValueError, FileNotFoundError, OSError, KeyError) as err:
        raise UsageError(f"{err}") from None
    if len(getattr(tokenizer, "tokenizer", tokenizer)) == 0:  # a vision-language model's processor holds it
        raise UsageError(f"the tokenizer in {config.model.path} is empty")
    return Prepared(config, device, model, tokenizer, examples, locked)


def _setup_logging() -> None:
    """Log lines on stderr: INFO and above, and under torchrun on ranks other than 0 WARNING
    and above. Their INFO lines repeat rank 0's (the decode path, the warm-up's loss, a
    resume's checkpoint) once per rank: on 8 ranks a line a user reads eight times. A
    warning or an error stays on every rank: it may be that rank's alone."""
    import logging
    import os

    level = logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def _prepared(args, command: str):
    """``prepare`` for ``command``, logging set up; None after a one-line usage error."""
    try:
        ready = prepare(args, command)
    except UsageError as err:
        log(f"portarl {command}: {err}")
        return None
    _setup_logging()
    return ready


def cmd_train(args) -> int:
    ready = _prepared(args, "train")
    if ready is None:
        return 2
    from portarl.runtime import distributed as pdist

    agreed = False  # an exception on this rank: leave alone, never wait for the others
    output_dir, locked = ready.config.output_dir, ready.locked
    try:
        code, agreed = _train(args, ready)
    finally:
        ready = None  # the model (FSDP2-sharded: it holds the process group) goes with the trainer
        pdist.shutdown(agreed=agreed)
        if locked:
            from portarl.trainer.run import lock as run_lock

            run_lock.release(output_dir)
    return code


def _train(args, ready: Prepared) -> tuple[int, bool]:
    """Train and report; ``(exit code, whether every rank leaves together)``. Every reference
    to the trainer dies with this frame, so the caller can release the process group."""
    from portarl.backends.device import DeviceUnavailableError
    from portarl.assets.reward_runner import RewardError
    from portarl.trainer import GRPOTrainer, TrainingStopped
    from portarl.trainer.checkpoint import CheckpointError
    from portarl.trainer.run.output_dir import RunDirError
    from portarl.trainer.run.signals import AbortNow, StopRequested, abort_message, exit_code
    from portarl.trainer.run.write_failure import EXIT_CODE as WRITE_EXIT
    from portarl.runtime import distributed as pdist
    from portarl.runtime.continuation import continue_command
    from portarl.runtime.heartbeat import EXIT_RANK_LOST
    from portarl.trainer.run.write_failure import WriteFailed, as_write_failure, intact_checkpoint

    config = ready.config
    try:
        trainer = GRPOTrainer(ready.model, ready.tokenizer, None, ready.examples, config, device=config.device)
    except (DeviceUnavailableError, ValueError, FileNotFoundError, RewardError) as err:
        log(f"portarl train: {err}")
        return 2, False
    ready.model = None
    if trainer.dist.is_main:  # once, not once per rank
        log(f"portarl train: {config.model.path} model on {trainer.device}, output in {config.output_dir}")
    from portarl.cli.plan import log_train_plan  # after every set-up error: those stay one line

    log_train_plan(config, ready.tokenizer, ready.examples, ready.device)
    try:
        result = trainer.train(resume=args.resume or args.resume_or_start, overwrite=args.overwrite,
                               start_if_none=args.resume_or_start)
    except RunDirError as err:
        log(f"portarl train: {err}")
        return 2, False
    except TrainingStopped as err:  # agreed by every rank; reported here only (the event is not logged too)
        log(f"portarl train: {err}")
        return 3, True
    except CheckpointError as err:
        log(f"portarl train: {err}")
        return 2, False
    except (WriteFailed, OSError) as err:  # disk full, a file-size limit, no permission: see write_failure
        failure = err if isinstance(err, WriteFailed) else as_write_failure(err, config.output_dir)
        if failure is None:
            raise
        command = continue_command(getattr(args, "argv", ["train"]), config.output_dir, trainer.checkpoints.latest())
        log(f"portarl train: {failure}; {intact_checkpoint(trainer)}; make room (or fix the permissions), then "
            f"continue with: {command}")
        return WRITE_EXIT, False
    except StopRequested as err:  # agreed by every rank at the end of a step
        log(f"portarl train: {err}; continue with --resume")
        return exit_code(err.signum), True
    except AbortNow as err:  # a second signal: this rank leaves at once
        log(f"portarl train: {abort_message(err, trainer)}")
        return exit_code(err.signum), False
    except KeyboardInterrupt as err:  # during resume, before the loop: nothing new to save
        log(f"portarl train: interrupted ({err or 'SIGINT'}) before training began; no checkpoint saved")
        return exit_code(getattr(err, "signum", None)), False
    except RuntimeError as err:
        gone = pdist.peer_gone(err)
        if gone is None:
            raise
        # Another rank died (its own line says why, and torchrun names it): one line here, not
        # the collective's traceback, and the exit status of a lost rank.
        latest = trainer.checkpoints.latest()
        command = continue_command(getattr(args, "argv", ["train"]), config.output_dir, latest)
        # Several nodes: a node that died has no torchrun left to name its rank, so name it here.
        lost = pdist.lost_peers() if pdist.nodes() > 1 else None
        what = (f"{lost}: that node died or its processes were killed; a line of its own, if any, is in that node's log"
                if lost else "its own line says why")
        log(f"portarl train: rank {trainer.dist.rank}: another rank's process ended during step {trainer.step + 1} "
            f"(a collective: {gone}); {what}; "
            + (f"the newest checkpoint is {latest}; continue with: {command}" if latest
               else f"there is no checkpoint yet; start again with: {command}"))
        return EXIT_RANK_LOST, False
    finally:
        trainer.close()
    if trainer.dist.is_main:
        print(result.summary)
        print(f"metrics: {config.output_dir}/metrics.jsonl   checkpoint: {result.checkpoint}", flush=True)
    return 0, True


def cmd_sft(args) -> int:
    ready = _prepared(args, "sft")
    if ready is None:
        return 2
    import shutil

    from portarl.assets.lora import apply_lora, save_merged
    from portarl.trainer.run.progress import progress_bar
    from portarl.vision.codec import codec_for
    from portarl.trainer.phases.sft import demonstrations, run_sft

    config = ready.config
    steps = args.steps or config.train.sft_warmup_steps or 100
    try:
        codec = codec_for(ready.tokenizer, ready.model)
        examples = demonstrations(config, ready.examples)  # data.sft_path when set
        if config.model.lora is not None:  # the adapter is trained; sft-model/ gets it merged in
            ready.model = apply_lora(ready.model, config.model.lora, seed=config.model.init_seed)
        ready.model.to(ready.device)
        bar = progress_bar(steps, "sft", enabled=config.logging.progress)
        blackbox.note(step=1, phase="sft")

        def on_step(i, loss):
            blackbox.note(step=i + 1)  # the step under way, for a supervising parent
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}")
            elif i % 10 == 0 or i == steps:
                log(f"sft step {i}/{steps}: loss {loss:.4f}")

        try:
            losses = run_sft(ready.model, codec, examples, steps=steps, batch_size=config.train.sft_batch_size,
                             lr=config.train.sft_lr, device=ready.device, seed=config.train.seed, on_step=on_step,
                             logits_policy=config.precision.logits)
        finally:
            if bar is not None:
                bar.close()
    except (ValueError, FloatingPointError, FileNotFoundError) as err:
        log(f"portarl sft: {err}")
        return 2
    except KeyboardInterrupt:
        log("portarl sft: interrupted; nothing saved")
        return 130
    out = Path(config.output_dir) / "sft-model"
    if out.exists():  # --overwrite (checked before training)
        shutil.rmtree(out)
    save_merged(ready.model, out, ready.tokenizer)  # a plain HF directory, LoRA merged in
    print(f"sft: loss {losses[0]:.4f} -> {losses[-1]:.4f} over {steps} steps; model saved to {out} "
          f"(train on it with --set model.path={out})")
    return 0
