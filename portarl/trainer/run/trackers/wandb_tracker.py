"""Weights & Biases (``logging.wandb``; ``pip install 'portarl[wandb]'``).

Every metric goes with ``step=`` the run's step (never W&B's own counter): an offline run
continued by ``--resume`` writes a new offline folder holding the same run id, and ``wandb
sync`` of both folders then lays the steps end to end in one run.

Offline (``mode: offline`` or ``WANDB_MODE=offline``) W&B is also told so before its run
starts (``wandb.setup``): otherwise its process-wide telemetry is built for an online run and
tries to reach the W&B server from an offline job. At the end, ``wandb.teardown()`` stops the
``wandb-core`` process W&B started, so none outlives the run (unless a W&B run of the user's
own, in the same process, is still active: it needs that process).
"""

from __future__ import annotations

import os

from portarl.trainer.run.trackers.common import RunInfo, setting


class WandbTracker:
    name = "wandb"

    def __init__(self, section, *, run: RunInfo, resume_id: str | None = None):
        import wandb

        self._wandb = wandb
        mode = section.mode or os.environ.get("WANDB_MODE") or None
        if mode in ("offline", "disabled"):
            wandb.setup(settings=wandb.Settings(mode=mode))
        directory = setting(section.dir, ("WANDB_DIR",), str(run.output_dir))
        if directory is not None:
            os.makedirs(directory, exist_ok=True)
        self.run = wandb.init(
            project=setting(section.project, ("WANDB_PROJECT",), "portarl"),
            entity=section.entity,
            name=setting(section.name, ("WANDB_NAME",), run.default_name),
            tags=list(section.tags) or None,
            mode=section.mode,
            dir=directory,
            config=run.config,
            id=resume_id,
            resume="allow" if resume_id else None,
            reinit="create_new",
        )
        self.run_id = self.run.id

    def metrics(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def samples(self, step: int, columns: list[str], rows: list[list]) -> None:
        self.run.log({"samples": self._wandb.Table(columns=columns, data=rows)}, step=step)

    def image(self, step: int, name: str, path) -> None:
        self.run.log({name: self._wandb.Image(str(path))}, step=step)

    def finish(self, status: str) -> None:
        try:
            self.run.finish(exit_code=0 if status == "finished" else 1)
        finally:
            if self._wandb.run is None:  # no run of the user's own in this process still needs W&B's service
                self._wandb.teardown()
