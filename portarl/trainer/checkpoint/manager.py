"""Atomic, verified checkpoints: nothing a crash interrupts is ever taken for a checkpoint,
and nothing damaged after the fact is loaded.

Layout: ``<output_dir>/checkpoints/step-000012/`` holding the model (``model.safetensors``,
via ``save_pretrained``) or its DCP shards (``dcp/``), the tokenizer, the trainer state
(``trainer_state.json`` + ``trainer_state.safetensors``, see :mod:`.safe_state`),
``MANIFEST.json`` and ``COMPLETE``. A checkpoint is written into a temporary directory,
every file fsynced, the manifest written from the bytes read back, ``COMPLETE`` last; then
the directory is renamed into place and its parent fsynced.

Loading (:meth:`CheckpointManager.load_newest_verified`) walks the complete checkpoints
newest first, verifies each against its manifest and uses the first that verifies, saying
which ones it skipped and why; a checkpoint that fails is moved aside to
``corrupt-step-XXXXXX`` so that pruning never counts it as one of the ``keep_last``.
Pruning never removes the checkpoint just written (verified as it was written) and removes
``COMPLETE`` before the rest.

A checkpoint of a step is never replaced by a poorer one of the same step: a run saves a
step once more only when it stops during the next one (its worker died, a reward failed,
a guard stopped it), and what it would save then holds less than the checkpoint written at
the end of that step (async mode: no batches in flight, the pipeline having failed; the
random states already advanced by the failed step). So a step of which this manager wrote
a complete checkpoint, or resumed from one it verified, is kept, and the save returns it
(:meth:`CheckpointManager.kept`). Any other checkpoint of the step is replaced: a resumed
run only reaches a newer step's directory when that checkpoint could not be verified.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from pathlib import Path


from portarl.runtime.fileperms import normalize_modes
from portarl.trainer.checkpoint import manifest as mf
from portarl.trainer.checkpoint import safe_state
from portarl.trainer.checkpoint.manifest import STEP_DIR as _STEP_DIR
from portarl.trainer.checkpoint.manifest import CheckpointError, step_of
from portarl.trainer.run.write_failure import writing

log = logging.getLogger("portarl.train")
_REPLACED = ".replaced-"


class CheckpointManager:
    def __init__(self, output_dir: str | Path, keep_last: int = 2):
        self.root = Path(output_dir) / "checkpoints"
        self.keep_last = keep_last
        self.intact: dict[int, Path] = {}  # step -> the complete checkpoint this manager wrote or resumed from

    # ------------------------------------------------------------------ listing
    def clean_partial(self) -> list[Path]:
        """Remove temporary directories left by an interrupted write (and step directories
        without ``COMPLETE``). What could not be removed is logged, not reported as removed."""
        removed = []
        if self.root.exists():
            for path in sorted(self.root.iterdir()):
                if path.name.startswith(_REPLACED) and not (self.root / path.name[len(_REPLACED):]).exists():
                    os.rename(path, self.root / path.name[len(_REPLACED):])  # a re-save was interrupted
                    log.warning("restored %s, whose replacement was interrupted", path.name[len(_REPLACED):])
                    continue
                partial = _STEP_DIR.match(path.name) and not (path / mf.COMPLETE).exists()
                if path.name.startswith((".tmp-", _REPLACED)) or partial:
                    problems = mf.remove_checkpoint(path)
                    if problems:
                        log.warning("could not remove the incomplete checkpoint %s: %s", path, "; ".join(problems))
                    else:
                        removed.append(path)
        return removed

    def complete(self) -> list[Path]:
        if not self.root.exists():
            return []
        dirs = [p for p in self.root.iterdir() if _STEP_DIR.match(p.name) and (p / mf.COMPLETE).exists()]
        return sorted(dirs, key=step_of)

    def latest(self) -> Path | None:
        """The newest COMPLETE-marked checkpoint (not verified: see :meth:`newest_verified`)."""
        done = self.complete()
        return done[-1] if done else None

    def newest_verified(self) -> Path | None:
        for directory in reversed(self.complete()):
            try:
                mf.verify(directory)
                return directory
            except CheckpointError:
                continue
        return None

    # ------------------------------------------------------------------ writing
    def kept(self, step: int, *, look: bool = True) -> Path | None:
        """The complete checkpoint of ``step`` this manager wrote or resumed from, which a
        save of the same step keeps (see the module docstring); None when there is none.
        ``look=False``: from the record alone (under torchrun every rank must decide alike)."""
        path = self.intact.get(step)
        if path is None or (look and not (path / mf.COMPLETE).exists()):
            return None
        log.info("checkpoint of step %d kept: %s (written at the end of that step; saving it again now would keep "
                 "less)", step, path)
        return path

    def _begin(self, step: int, suffix: str) -> tuple[Path, Path]:
        tmp = self.root / f".tmp-step-{step:06d}{suffix}"
        with writing(tmp):
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        return tmp, self.root / f"step-{step:06d}"

    @staticmethod
    @contextlib.contextmanager
    def _writing_into(tmp: Path):
        """A failed write into ``tmp`` (disk full, a file-size limit, no permission: a
        :class:`~portarl.trainer.run.write_failure.WriteFailed` naming the file) removes the
        partial ``.tmp-step-*`` at once; the checkpoints before it are untouched."""
        try:
            with writing(tmp):
                yield
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _finish(self, step: int, tmp: Path, final: Path) -> Path:
        normalize_modes(tmp)  # safetensors writes 0600; every file gets the umask's mode
        mf.fsync_tree(tmp)
        digest = mf.write_manifest(tmp, step)
        mf.write_complete(tmp, step, digest)
        mf.fsync_tree(tmp)
        replaced = None
        if final.exists():  # re-saving a step (resume after a crash right after a save)
            # Moved aside, not deleted, until the new one is in place: a kill in between leaves
            # it recoverable by clean_partial (with keep_last=1 it may be the only checkpoint).
            replaced = self.root / f"{_REPLACED}{final.name}"
            if replaced.exists():
                mf.remove_checkpoint(replaced)
            os.rename(final, replaced)
            mf.fsync_dir(self.root)
        os.rename(tmp, final)
        mf.fsync_dir(self.root)
        if replaced is not None:
            problems = mf.remove_checkpoint(replaced)
            if problems:
                log.warning("could not remove the replaced checkpoint %s: %s", replaced, "; ".join(problems))
        self.prune(protect=final)
        self.intact[step] = final
        return final

    def save(self, step: int, model, tokenizer, state: dict) -> Path:
        """A LoRA (peft) model's ``save_pretrained`` writes its adapter only
        (``adapter_model.safetensors``, ``adapter_config.json``), not the base weights."""
        if (kept := self.kept(step)) is not None:
            return kept
        tmp, final = self._begin(step, f"-{os.getpid()}")
        with self._writing_into(tmp):
            with writing(tmp / "model.safetensors"):  # its own file name when the error has one (a LoRA adapter)
                model.save_pretrained(tmp, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            with writing(tmp / safe_state.STATE_TENSORS):
                safe_state.save_state(state, tmp)
            return self._finish(step, tmp, final)

    def save_sharded(self, step: int, model, optimizer, tokenizer, state: dict, ctx) -> Path:
        """Every rank writes its shards with torch.distributed.checkpoint (DCP: loadable on any
        number of ranks, or on one process); rank 0 writes the trainer state, the manifest and
        ``COMPLETE`` and renames the directory into place."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        from portarl.runtime import distributed as pdist

        if (kept := self.kept(step, look=False)) is not None:
            return kept
        tmp, final = self.root / f".tmp-step-{step:06d}", self.root / f"step-{step:06d}"
        if ctx.is_main:
            self._begin(step, "")
        pdist.barrier(ctx)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
        pdist.barrier(ctx)
        if ctx.is_main:
            with self._writing_into(tmp):
                if tokenizer is not None:
                    tokenizer.save_pretrained(tmp)
                with writing(tmp / safe_state.STATE_TENSORS):
                    safe_state.save_state(state, tmp)
                self._finish(step, tmp, final)
        pdist.barrier(ctx)
        self.intact[step] = final
        return final

    def prune(self, protect: Path) -> None:
        """Keep the newest ``keep_last`` complete checkpoints and always ``protect`` (the one
        just written, verified as it was written); remove the others, ``COMPLETE`` first."""
        done = self.complete()
        keep = set(done[-self.keep_last:]) | {protect}
        for old in done:
            if old in keep or step_of(old) > step_of(protect):
                continue  # never remove what is newer than the checkpoint just written
            problems = mf.remove_checkpoint(old)
            if problems:
                log.warning("pruning: could not remove all of %s: %s", old, "; ".join(problems))
            else:
                log.info("pruning: removed %s (keep_last=%d)", old, self.keep_last)

    # ------------------------------------------------------------------ reading
    def quarantine(self, directory: Path) -> Path | None:
        """Move a checkpoint that failed verification out of the ``step-*`` namespace (kept
        for inspection; never loaded or counted by pruning again)."""
        target = self.root / f"corrupt-{directory.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        try:
            os.rename(directory, target)
            mf.fsync_dir(self.root)
            return target
        except OSError as err:
            log.warning("could not move the damaged checkpoint %s aside: %s", directory, err)
            return None

    def load_newest_verified(self, *, quarantine: bool = True, load=None) -> tuple[Path, dict] | None:
        """The newest checkpoint that verifies and whose state reads, with that state.

        ``load(directory, state)``: the rest of loading (the weights), under the same rule:
        a read error there (:class:`CheckpointError`: ``model.safetensors`` that matches
        its manifest but cannot be parsed, an adapter, DCP shards) skips that checkpoint
        too, so every file of a checkpoint falls back alike. Each one skipped is logged with
        the file at fault and moved aside; when none is usable the error lists every
        checkpoint and why. ``None`` when there are no checkpoints at all."""
        candidates = list(reversed(self.complete()))
        if not candidates:
            return None
        failures = []
        for directory in candidates:
            try:
                mf.verify(directory)
                state = safe_state.load_state(directory)
                if load is not None:
                    load(directory, state)
            except (CheckpointError, safe_state.UnsafeStateError) as err:
                failures.append(str(err))
                moved = self.quarantine(directory) if quarantine else None
                log.warning("checkpoint unusable: %s%s", err, f"; moved to {moved}" if moved else "")
                continue
            if failures:
                log.warning("falling back to %s, the newest checkpoint that verifies", directory)
            self.intact[step_of(directory)] = directory
            return directory, state
        raise CheckpointError("no checkpoint in {} verifies:\n  {}\nRestore a good copy or start without "
                              "--resume (in a new output directory).".format(self.root, "\n  ".join(failures)),
                              self.root)

    @staticmethod
    def load_state(directory: Path) -> dict:
        """Verify ``directory`` and read its trainer state (no pickle)."""
        mf.verify(directory)
        return safe_state.load_state(directory)

    @staticmethod
    def load_sharded(directory: Path, model, optimizer, *, verify: bool = True) -> None:
        """Load a DCP checkpoint into ``model`` / ``optimizer``, sharded or not (resharding to
        this run's number of ranks). The manifest is verified first, so only files it vouches
        for reach DCP (``verify=False``: the caller has just verified it, e.g.
        :meth:`load_newest_verified`); and DCP's pickles are read with allow-lists
        (:mod:`.safe_dcp`), so even a file whose manifest was rewritten cannot run code."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        if verify:
            mf.verify(directory)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        from portarl.trainer.checkpoint.safe_dcp import SafeFileSystemReader, SafeLoadPlanner, load_metadata_safely

        meta = directory / "dcp" / ".metadata"  # checked here first: DCP would wrap our error in its own
        load_metadata_safely(meta.read_bytes(), str(meta))
        try:  # a shard that cannot be read fails on every rank (DCP gathers the ranks' errors)
            dcp.load(state, storage_reader=SafeFileSystemReader(str(directory / "dcp")), planner=SafeLoadPlanner())
        except dcp.CheckpointException as err:
            raise CheckpointError(f"checkpoint {directory}: the DCP shards cannot be read ({err})", directory,
                                  "dcp") from None
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    @staticmethod
    def is_sharded(directory: Path) -> bool:
        return (directory / "dcp").is_dir()

    @staticmethod
    def load_weights(model, directory: Path, *, verify: bool = True) -> None:
        """Load ``model.safetensors`` into ``model`` (after verifying the manifest unless the
        caller just did); for a LoRA (peft) model, its adapter only (:mod:`portarl.assets.lora`)."""
        from safetensors.torch import load_model

        from portarl.assets.lora import is_lora, load_adapter

        if verify:
            mf.verify(directory)
        if is_lora(model):  # the checkpoint holds the adapter; the base weights came from model.path
            return load_adapter(model, directory)
        path = directory / "model.safetensors"
        from portarl.moe.routing import is_moe
        from portarl.vision.models import is_vision_config

        if is_vision_config(getattr(model, "config", None)) or is_moe(model):
            # save_pretrained writes a Qwen-VL model under its checkpoint names (visual.*, model.layers.*),
            # and an MoE model's fused experts (experts.gate_up_proj [E, 2I, H]) as one tensor per
            # expert (experts.0.gate_proj.weight, ...), not its module names: transformers' loader maps them back.
            return CheckpointManager._load_renamed(model, directory)
        try:
            missing, unexpected = load_model(model, str(path), strict=False)
        except Exception as err:  # safetensors' own error types for a bad header
            raise CheckpointError(f"checkpoint {directory}: model.safetensors cannot be read ({err})", directory,
                                  "model.safetensors") from None
        # save_pretrained drops tied weights (lm_head tied to the embeddings): those may be
        # missing; anything else means the checkpoint does not match the model.
        state = model.state_dict()
        loaded_ptrs = {state[k].data_ptr() for k in state if k not in missing}
        real_missing = [k for k in missing if state[k].data_ptr() not in loaded_ptrs]
        if real_missing or unexpected:
            raise RuntimeError(
                f"checkpoint {directory} does not match the model: missing {real_missing[:5]}, unexpected {unexpected[:5]}"
            )


    @staticmethod
    def _load_renamed(model, directory: Path) -> None:
        """Weights whose saved names transformers renames on load (a vision-language
        model, a mixture-of-experts model's experts): loaded by ``from_pretrained`` (on the CPU, the model's dtype) and copied in,
        strictly: every parameter and buffer must be there."""
        dtype = next(model.parameters()).dtype
        try:
            saved = type(model).from_pretrained(directory, dtype=dtype, local_files_only=True)
        except (OSError, ValueError) as err:
            raise CheckpointError(f"checkpoint {directory}: model.safetensors cannot be read ({err})", directory,
                                  "model.safetensors") from None
        try:
            model.load_state_dict(saved.state_dict(), strict=True)
        except RuntimeError as err:
            first = str(err).splitlines()[0]
            raise RuntimeError(f"checkpoint {directory} does not match the model: {first}") from None


__all__ = ["CheckpointManager", "CheckpointError", "step_of"]
