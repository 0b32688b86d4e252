"""MLflow (``logging.mlflow``; ``pip install 'portarl[mlflow]'``).

Through an ``MlflowClient`` of its own rather than ``mlflow.start_run``: the fluent API keeps
one active run per process in a global, which a user's own MLflow code in the same process
would share. The tracking URI is ``logging.mlflow.tracking_uri``, else
``$MLFLOW_TRACKING_URI``, else MLflow's default (``sqlite:///mlflow.db`` in the working
directory). Artifacts (the sample tables as JSON, ``curves.png``, ``config.yaml``) go to the
experiment's artifact location: for an experiment this run creates on a local database,
MLflow's default, ``./mlruns`` in the working directory.

The config is logged as parameters (``section.field``, as MLflow has no nested config; values
cut at 500 characters: the whole file is the ``config.yaml`` artifact). A resumed run logs
only parameters its run does not have yet: MLflow refuses to change a parameter's value, and
the values of the first start (those a resume may change: steps, learning rate, logging) are
in the ``config.yaml`` of each start.
"""

from __future__ import annotations

import os
import time

from portarl.trainer.run.trackers.common import RunInfo, flat_config

#: MLflow's run states for portarl's outcomes.
STATUSES = {"finished": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}
#: A parameter value longer than this is cut (MLflow servers cap values; 500 on older ones).
PARAM_CHARS = 500
#: Parameters and metrics per ``log_batch`` call (MLflow's limits: 100 and 1000).
PARAMS_PER_CALL, METRICS_PER_CALL = 100, 1000


class MlflowTracker:
    name = "mlflow"

    def __init__(self, section, *, run: RunInfo, resume_id: str | None = None):
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self._Param = Param
        self.client = MlflowClient(section.tracking_uri)  # None: $MLFLOW_TRACKING_URI, else MLflow's default
        params = {k: (v if len(v) <= PARAM_CHARS else v[: PARAM_CHARS - 3] + "...")
                  for k, v in flat_config(run.config).items()}
        existing = None
        if resume_id is not None:
            try:
                existing = self.client.get_run(resume_id)
            except MlflowException:
                existing = None  # another tracking store now: a run of its own there
        if existing is not None:
            self.run_id = resume_id
            self.client.update_run(resume_id, status="RUNNING")
            params = {k: v for k, v in params.items() if k not in existing.data.params}
        else:
            name = section.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "portarl"
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment is not None else self.client.create_experiment(name)
            tags = {tag: "true" for tag in section.tags}
            created = self.client.create_run(experiment_id, run_name=section.name or run.default_name, tags=tags)
            self.run_id = created.info.run_id
        items = [self._Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=items[i: i + PARAMS_PER_CALL])
        config_file = run.output_dir / "config.yaml"
        if config_file.is_file():
            self.client.log_artifact(self.run_id, str(config_file), artifact_path=f"config/step-{run.start_step:06d}")

    def metrics(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(items), METRICS_PER_CALL):
            self.client.log_batch(self.run_id, metrics=items[i: i + METRICS_PER_CALL])

    def samples(self, step: int, columns: list[str], rows: list[list]) -> None:
        self.client.log_dict(self.run_id, {"columns": columns, "data": rows}, f"samples/step-{step:06d}.json")

    def image(self, step: int, name: str, path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def finish(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=STATUSES.get(status, "FAILED"))
