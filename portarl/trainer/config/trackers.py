"""``logging.trackers`` and each tracker's settings (``logging.wandb``, ``logging.swanlab``,
``logging.mlflow``, ``logging.trackio``), apart from :mod:`portarl.trainer.config` so that
module stays readable; the trackers themselves are :mod:`portarl.trainer.run.trackers`.

Why settings default to null: each tracker has environment variables of its own
(``WANDB_PROJECT``, ``SWANLAB_MODE``, ``MLFLOW_TRACKING_URI``, ``TRACKIO_DIR`` ...) that a
cluster's job template or a team's shell profile sets; a field left null lets them apply,
and only where neither says anything does portarl fill in a name (project ``portarl``, the
run named after the output directory). See docs/trackers.md.
"""

from __future__ import annotations

import dataclasses

from portarl.trainer.config.fields import ConfigError, _check

#: The names ``logging.trackers`` accepts, in the order the docs list them.
TRACKER_NAMES = ("tensorboard", "wandb", "swanlab", "mlflow", "trackio")


def _text(section: str, obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _check(value is None or (isinstance(value, str) and bool(value.strip())), f"{section}.{name}",
               "must be a non-empty string or null", value)


def _tags(section: str, obj) -> None:
    tags = obj.tags
    ok = isinstance(tags, list) and all(isinstance(t, str) and t.strip() for t in tags)
    _check(ok, f"{section}.tags", "must be a list of non-empty strings (e.g. [grpo, qwen])", tags)


def _mode(section: str, obj, modes: tuple[str, ...]) -> None:
    _check(obj.mode is None or obj.mode in modes, f"{section}.mode", f"must be one of {', '.join(modes)} or null",
           obj.mode)


@dataclasses.dataclass
class WandbSection:
    """``logging.wandb``: Weights & Biases (``pip install 'portarl[wandb]'``)."""

    #: W&B project; null: $WANDB_PROJECT, else "portarl".
    project: str | None = None
    #: Team or user the run belongs to; null: $WANDB_ENTITY, else your default entity.
    entity: str | None = None
    #: Run name; null: $WANDB_NAME, else the output directory's name.
    name: str | None = None
    #: Run tags; empty: $WANDB_TAGS (comma-separated), if set.
    tags: list[str] = dataclasses.field(default_factory=list)
    #: "online", "offline" (files only; `wandb sync` uploads them later) or "disabled"; null: $WANDB_MODE, else online.
    mode: str | None = None
    #: Directory W&B writes its wandb/ folder into; null: $WANDB_DIR, else the output directory.
    dir: str | None = None

    def validate(self):
        _text("logging.wandb", self, "project", "entity", "name", "dir")
        _tags("logging.wandb", self)
        _mode("logging.wandb", self, ("online", "offline", "disabled"))


@dataclasses.dataclass
class SwanlabSection:
    """``logging.swanlab``: SwanLab (``pip install 'portarl[swanlab]'``)."""

    #: SwanLab project; null: $SWANLAB_PROJ_NAME, else "portarl".
    project: str | None = None
    #: Workspace (organisation) the project belongs to; null: $SWANLAB_WORKSPACE, else your own.
    workspace: str | None = None
    #: Experiment name; null: $SWANLAB_EXP_NAME, else the output directory's name.
    name: str | None = None
    #: Experiment tags; empty: $SWANLAB_TAGS, if set.
    tags: list[str] = dataclasses.field(default_factory=list)
    #: "online" (cloud), "offline" (files; `swanlab sync` uploads them later), "local" (needs swanlab[dashboard]) or "disabled"; null: $SWANLAB_MODE, else online.
    mode: str | None = None
    #: Directory of SwanLab's run folders; null: $SWANLAB_LOG_DIR, else <output_dir>/swanlog.
    log_dir: str | None = None

    def validate(self):
        _text("logging.swanlab", self, "project", "workspace", "name", "log_dir")
        _tags("logging.swanlab", self)
        _mode("logging.swanlab", self, ("online", "offline", "local", "disabled"))


@dataclasses.dataclass
class MlflowSection:
    """``logging.mlflow``: MLflow (``pip install 'portarl[mlflow]'``)."""

    #: Tracking URI: a server (http://host:5000), a local database (sqlite:///mlflow.db) or a databricks URI; null: $MLFLOW_TRACKING_URI, else MLflow's default (sqlite:///mlflow.db in the working directory).
    tracking_uri: str | None = None
    #: Experiment name; null: $MLFLOW_EXPERIMENT_NAME, else "portarl".
    experiment: str | None = None
    #: Run name; null: the output directory's name.
    name: str | None = None
    #: Run tags (MLflow tags are key / value: each is set with the value "true").
    tags: list[str] = dataclasses.field(default_factory=list)

    def validate(self):
        _text("logging.mlflow", self, "tracking_uri", "experiment", "name")
        _tags("logging.mlflow", self)


@dataclasses.dataclass
class TrackioSection:
    """``logging.trackio``: Trackio (``pip install 'portarl[trackio]'``): a local SQLite
    database under $TRACKIO_DIR unless a Hugging Face Space or a server is named."""

    #: Trackio project; null: "portarl".
    project: str | None = None
    #: Run name (Trackio resumes a run by its name); null: the output directory's name.
    name: str | None = None
    #: Group the run is shown in.
    group: str | None = None
    #: A Hugging Face Space to log to ("user/space"); null: $TRACKIO_SPACE_ID, else local.
    space_id: str | None = None

    def validate(self):
        _text("logging.trackio", self, "project", "name", "group", "space_id")


SECTIONS = {"wandb": WandbSection, "swanlab": SwanlabSection, "mlflow": MlflowSection, "trackio": TrackioSection}


def tracker_list(value) -> list[str]:
    """``logging.trackers`` as given (a list, or one name) as a checked list of names."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
        raise ConfigError(f"logging.trackers must be a list of tracker names ({', '.join(TRACKER_NAMES)}), got {value!r}")
    names = [n.strip().lower() for n in value]
    for name in names:
        if name not in TRACKER_NAMES:
            raise ConfigError(f"logging.trackers: unknown tracker {name!r}; known: {', '.join(TRACKER_NAMES)}")
    if len(set(names)) != len(names):
        raise ConfigError(f"logging.trackers names a tracker twice: {value!r}")
    return names


def tracker_section(name: str, value):
    """``logging.<name>`` as given (a mapping, null, or the section) as a validated section."""
    from portarl.trainer.config.fields import _build, _mapping

    cls = SECTIONS[name]
    if not isinstance(value, cls):
        value = _build(cls, f"logging.{name}", _mapping(f"logging.{name}", value))
    value.validate()
    return value
