"""Trackio (``logging.trackio``; ``pip install 'portarl[trackio]'``).

Local first: a project is a SQLite database under ``$TRACKIO_DIR`` (Trackio's default
``~/.cache/huggingface/trackio``; ``trackio show`` opens the dashboard) unless a Hugging Face
Space (``space_id`` / ``$TRACKIO_SPACE_ID``) or a server (``$TRACKIO_SERVER_URL``) is named.
Trackio resumes a run by its name, so the name is what the checkpoint keeps: a resumed run
continues the run it started, whatever ``logging.trackio.name`` says now.
"""

from __future__ import annotations

from portarl.trainer.run.trackers.common import RunInfo


class TrackioTracker:
    name = "trackio"

    def __init__(self, section, *, run: RunInfo, resume_id: str | None = None):
        import trackio

        self._trackio = trackio
        self.run = trackio.init(
            project=section.project or "portarl",
            name=resume_id or section.name or run.default_name,
            group=section.group,
            space_id=section.space_id,
            config=run.config,
            resume="allow" if resume_id else "never",
        )
        self.run_id = self.run.name

    def metrics(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def samples(self, step: int, columns: list[str], rows: list[list]) -> None:
        self.run.log({"samples": self._trackio.Table(columns=columns, data=rows)}, step=step)

    def image(self, step: int, name: str, path) -> None:
        self.run.log({name: self._trackio.Image(str(path))}, step=step)

    def finish(self, status: str) -> None:
        """The run finished, and no longer Trackio's current run (``trackio.finish()`` does
        both): left current, Trackio's exit hook finished it a second time at exit."""
        from trackio import context_vars

        if context_vars.current_run.get() is self.run:
            self._trackio.finish()
        else:
            self.run.finish()
