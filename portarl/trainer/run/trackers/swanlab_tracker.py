"""SwanLab (``logging.swanlab``; ``pip install 'portarl[swanlab]'``).

Modes: ``online`` (SwanLab's cloud or a private deployment), ``offline`` (the run's records
in files under ``log_dir``; ``swanlab sync`` uploads them later, a resumed run's folder into
the same experiment, since it holds the same run id), ``local`` (the files plus the local
dashboard's database, ``swanlab watch``; it needs ``pip install 'swanlab[dashboard]'``, and
the dashboard shows each start of a resumed run as an experiment of its own), ``disabled``.

Two of SwanLab's side effects are undone at the end: its SIGINT handler and excepthook
(``run.finish`` restores them; portarl's own handlers are installed after SwanLab starts and
removed before it finishes, so the order holds), and the file watcher's inotify thread, which
SwanLab 0.10 leaves running when it had no file to watch (watchdog's observer starts that
thread when it is made, and SwanLab stops only an observer it started): it is stopped and
joined here, so no thread outlives the run.
"""

from __future__ import annotations

import threading

from portarl.trainer.run.trackers.common import RunInfo, setting

#: SwanLab's finish states for portarl's outcomes.
STATES = {"finished": "success", "failed": "crashed", "interrupted": "aborted"}


class SwanlabTracker:
    name = "swanlab"

    def __init__(self, section, *, run: RunInfo, resume_id: str | None = None):
        import swanlab

        self._swanlab = swanlab
        self._threads_before = set(threading.enumerate())
        self.run = swanlab.init(
            project=setting(section.project, ("SWANLAB_PROJ_NAME", "SWANLAB_PROJECT_NAME"), "portarl"),
            workspace=section.workspace,
            name=setting(section.name, ("SWANLAB_EXP_NAME",), run.default_name),
            tags=list(section.tags) or None,
            mode=section.mode,
            log_dir=setting(section.log_dir, ("SWANLAB_LOG_DIR", "SWANLAB_LOGDIR"), str(run.output_dir / "swanlog")),
            config=run.config,
            id=resume_id,
            resume="allow" if resume_id else None,
            reinit=True,
        )
        self.run_id = self.run.id

    def metrics(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def samples(self, step: int, columns: list[str], rows: list[list]) -> None:
        texts = [self._swanlab.Text("\n".join(f"{c}: {v}" for c, v in zip(columns, row)), caption=f"sample {row[1]}")
                 for row in rows]
        self.run.log({"samples": texts}, step=step)

    def image(self, step: int, name: str, path) -> None:
        self.run.log({name: self._swanlab.Image(str(path))}, step=step)

    def finish(self, status: str) -> None:
        try:
            self.run.finish(state=STATES.get(status, "crashed"),
                            error=None if status == "finished" else f"the portarl run ended: {status}")
        finally:
            self._stop_leftover_watchers()

    def _stop_leftover_watchers(self) -> None:
        """watchdog's inotify threads that this run started and SwanLab left (the module
        docstring): each stopped (its ``stop()`` closes the inotify descriptor, ending its
        read loop) and joined."""
        for thread in set(threading.enumerate()) - self._threads_before:
            if type(thread).__name__ == "InotifyFD" and hasattr(thread, "stop"):
                thread.stop()
                thread.join()
