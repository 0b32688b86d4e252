"""Issue 62: ``logging.trackers`` (W&B, SwanLab, MLflow, Trackio beside TensorBoard), tested
for real and offline: each tracker's own files, databases and clients read back
(tests/trainer/tracker_readers.py), every metric of metrics.jsonl at its step, a resumed run
continuing the same tracker runs, a missing extra refused in one line before the model loads,
a tracker failing mid-run costing one warning, no thread or process left behind, async mode.

A tracker whose package is not installed skips its own checks with that reason (``pip install
'portarl[trackers]'`` installs all four; ``make test`` does, through the dev extra). SwanLab
runs in its offline mode: its local mode writes the same run files plus the dashboard's
database, and needs ``swanlab[dashboard]`` (swanboard 0.1.10b2, which pins rich 13 and is not
in the dev extra); the refusal of local mode without it is tested here.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import tracker_readers  # noqa: E402
from portarl.trainer import ConfigError, TrainConfig  # noqa: E402
from portarl.trainer.run.trackers import missing_extra  # noqa: E402
from portarl.trainer.run.trackers.fanout import RunInfo, Trackers, numbers, sample_table, setting  # noqa: E402

HERE = Path(__file__).resolve().parent
TRACKERS = ("wandb", "swanlab", "mlflow", "trackio")
INSTALLED = [name for name in TRACKERS if importlib.util.find_spec(name) is not None]
FAST = ["train.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=3", "data.synthetic_size=64",
        "model.hidden_size=32", "model.intermediate_size=64", "train.sft_warmup_steps=0", "train.micro_batch_size=8",
        "logging.progress=false", "optim.lr=1e-3"]
#: The offline / local settings of each tracker, as a user would write them.
OFFLINE = {"wandb": ["logging.wandb.mode=offline", "logging.wandb.tags=[grpo, tiny]"],
           "swanlab": ["logging.swanlab.mode=offline", "logging.swanlab.name=cfg-name"],
           "mlflow": [],  # the URI comes from $MLFLOW_TRACKING_URI (the tracker's own variable)
           "trackio": ["logging.trackio.project=tproj"]}


def needs(name: str):
    if name not in INSTALLED:
        pytest.skip(f"{name} is not installed (pip install 'portarl[{name}]')")


def _env(root: Path, **extra) -> dict:
    """The subprocess's environment: every tracker's files under ``root`` (a home of its own:
    no tracker writes into the real one), its own variables where a test sets them."""
    env = {**os.environ, "HOME": str(root / "home"), "TRACKIO_DIR": str(root / "trackio"),
           "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}", "WANDB_CONFIG_DIR": str(root / "home" / "wandb"),
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]), **extra}
    env.pop("TRITON_INTERPRET", None)
    for name in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_NAME", "WANDB_DIR", "SWANLAB_MODE", "SWANLAB_LOG_DIR",
                 "SWANLAB_PROJ_NAME", "SWANLAB_EXP_NAME", "MLFLOW_EXPERIMENT_NAME", "TRACKIO_SPACE_ID"):
        if name not in extra:
            env.pop(name, None)
    return env


def _train(root: Path, out: Path, *sets: str, resume: bool = False, env=None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "portarl", "train", "--device", "cpu", "--output-dir", str(out)]
    for item in (*FAST, *sets):
        cmd += ["--set", item]
    if resume:
        cmd.append("--resume")
    proc = subprocess.run(cmd, cwd=root, env=env or _env(root), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _assert_every_metric(rows: list[dict], steps: dict, tracker: str) -> None:
    """Each row's finite numbers are the tracker's values at the row's step, none missing."""
    assert sorted(steps) == [row["step"] for row in rows], f"{tracker}: steps {sorted(steps)}"
    for row in rows:
        want, got = numbers(row), steps[row["step"]]
        assert len(want) > 20, "a GRPO step logs its losses, rewards, KL, lengths, timings ..."
        missing = sorted(set(want) - set(got))
        assert not missing, f"{tracker}: step {row['step']} lacks {missing}"
        for key, value in want.items():
            assert math.isclose(got[key], value, rel_tol=1e-12, abs_tol=1e-300), \
                f"{tracker}: step {row['step']} {key} = {got[key]}, metrics.jsonl {value}"


def _trackio_runs(root: Path, project: str) -> dict:
    """Trackio's runs, read by Trackio's storage in a process of its own: Trackio fixes its
    directory ($TRACKIO_DIR) when it is first imported."""
    code = f"import json, tracker_readers; print(json.dumps(tracker_readers.trackio_runs({project!r})))"
    proc = subprocess.run([sys.executable, "-c", code], env=_env(root), capture_output=True, text=True, timeout=300,
                          check=True)
    runs = json.loads(proc.stdout.splitlines()[-1])
    for run in runs.values():
        run["steps"] = {int(step): values for step, values in run["steps"].items()}
    return runs


# ------------------------------------------------------------------ config and refusal


def test_logging_trackers_defaults_to_tensorboard_and_keeps_the_old_switch():
    assert TrainConfig().logging.active_trackers() == ["tensorboard"]
    assert TrainConfig.load(None, ["logging.tensorboard=false"]).logging.active_trackers() == []
    cfg = TrainConfig.load(None, ["logging.trackers=[wandb, mlflow]", "logging.tensorboard=true"])
    assert cfg.logging.active_trackers() == ["tensorboard", "wandb", "mlflow"]
    assert TrainConfig.load(None, ["logging.trackers=trackio"]).logging.active_trackers() == ["trackio"]
    saved = TrainConfig.from_dict(TrainConfig.load(None, ["logging.wandb.project=p", "logging.trackers=[wandb]"]).to_dict())
    assert saved.logging.wandb.project == "p" and saved.logging.active_trackers() == ["wandb"]
    for bad, needle in (("logging.trackers=[neptune]", "unknown tracker 'neptune'; known: tensorboard, wandb"),
                        ("logging.trackers=[wandb, wandb]", "names a tracker twice"),
                        ("logging.wandb.mode=cloud", "logging.wandb.mode must be one of online, offline, disabled"),
                        ("logging.swanlab.mode=cloud", "logging.swanlab.mode must be one of online, offline, local"),
                        ("logging.mlflow.tags=x", "logging.mlflow.tags must be a list"),
                        ("logging.trackio.colour=red", "unknown config field logging.trackio.colour")):
        with pytest.raises(ConfigError, match=needle):
            TrainConfig.load(None, [bad])


def test_a_setting_left_null_lets_the_trackers_own_variable_apply(monkeypatch):
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    assert setting(None, ("WANDB_PROJECT",), "portarl") == "portarl"
    assert setting("mine", ("WANDB_PROJECT",), "portarl") == "mine"
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    assert setting(None, ("WANDB_PROJECT",), "portarl") is None, "None: W&B reads its own variable"
    assert setting("mine", ("WANDB_PROJECT",), "portarl") == "mine", "the config wins over the variable"


def _hiding(root: Path, *modules: str) -> dict:
    """An environment whose Python finds none of ``modules`` (as if not installed)."""
    site = root / "hide"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text("import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in modules))
    env = _env(root)
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    return env


def test_a_missing_extra_is_refused_in_one_line_before_the_model_loads(tmp_path):
    """As a user sees it (a process of its own, wandb not importable in it); the model path
    does not exist, so the refusal must come before anything looks at the model."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "portarl", "train", "--output-dir", str(out), "--set", "model.path=/nowhere/model",
           "--set", "logging.trackers=[tensorboard, wandb]"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_hiding(tmp_path, "wandb"), capture_output=True, text=True,
                          timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and lines == [
        "portarl train: logging.trackers names wandb, but the wandb package is not installed: "
        "pip install 'portarl[wandb]' (or remove wandb from logging.trackers)"], proc.stderr
    assert not (out / "config.yaml").exists()


@pytest.mark.parametrize("sets,hidden,needle", [
    (["logging.trackers=[mlflow]"], ("mlflow",), "logging.trackers names mlflow, but the mlflow package is not "
                                                  "installed: pip install 'portarl[mlflow]'"),
    (["logging.trackers=[trackio]", "logging.tensorboard=true"], ("trackio",), "pip install 'portarl[trackio]'"),
    (["logging.trackers=[swanlab]", "logging.swanlab.mode=local"], ("swanboard",),
     "logging.swanlab.mode=local needs SwanLab's dashboard: pip install 'swanlab[dashboard]'"),
], ids=["mlflow", "trackio", "swanlab-local"])
def test_each_missing_package_is_one_line_from_the_cli_checks(tmp_path, monkeypatch, capsys, sets, hidden, needle):
    """The same checks in this process (the packages hidden as above); the model loader fails
    the test if it is reached."""
    import portarl.trainer.start.build as build
    from portarl.cli import train as cli_train

    cli_main = importlib.import_module("portarl.cli.main")  # the module (the package's ``main`` is its function)

    for module in hidden:
        monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.setattr(build, "build_policy", lambda *a, **k: pytest.fail("the model loaded before the refusal"))
    args = cli_main.build_parser().parse_args(
        ["train", "--output-dir", str(tmp_path / "run"), *[x for item in sets for x in ("--set", item)]])
    assert cli_train._prepared(args, "train") is None
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], lines


def test_missing_extra_names_the_first_missing_tracker(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "trackio" else object())
    assert missing_extra(["tensorboard", "wandb"]) is None, "TensorBoard warns instead (the train extra has it)"
    line = missing_extra(["wandb", "trackio"])
    assert line == ("logging.trackers names trackio, but the trackio package is not installed: "
                    "pip install 'portarl[trackio]' (or remove trackio from logging.trackers)")


# ------------------------------------------------------------------ the fan-out's policy


class StandIn:
    """A tracker that records what it is given, and fails where told."""

    def __init__(self, name, fail_at=None, fail_start=False, fail_finish=False):
        if fail_start:
            raise ConnectionError("no route to host")
        self.name, self.run_id, self.fail_at, self.fail_finish = name, f"id-{name}", fail_at, fail_finish
        self.steps, self.tables, self.images, self.finished = [], [], [], []

    def metrics(self, step, values):
        if step == self.fail_at:
            raise ConnectionError("quota exceeded")
        self.steps.append((step, values))

    def samples(self, step, columns, rows):
        self.tables.append((step, columns, rows))

    def image(self, step, name, path):
        self.images.append((step, name, path))

    def finish(self, status):
        self.finished.append(status)
        if self.fail_finish:
            raise OSError("disk full")


def test_a_tracker_that_fails_costs_one_warning_and_the_others_go_on(caplog, tmp_path, monkeypatch):
    import portarl.trainer.run.trackers.fanout as fanout

    made = {}
    specs = {"wandb": {"fail_start": True}, "mlflow": {"fail_at": 2}, "trackio": {"fail_finish": True}}
    monkeypatch.setattr(fanout, "_tracker_class", lambda name: lambda section, run, resume_id: made.setdefault(
        name, StandIn(name, **specs[name])))
    run = RunInfo(config={}, output_dir=tmp_path, default_name="run", start_step=0)
    with caplog.at_level(logging.WARNING, logger="portarl.train"):
        trackers = Trackers.start(["wandb", "mlflow", "trackio"], dict.fromkeys(specs), run)
        assert trackers.ids == {"mlflow": "id-mlflow", "trackio": "id-trackio"}
        for step in (1, 2, 3):
            trackers.metrics({"step": step, "reward/mean": step / 10, "phase": "grpo", "kl": float("nan")})
        trackers.samples(1, [{"step": 1, "sample": 0, "prompt": "1+1=", "completion": "2", "reward": 1.0,
                              "advantage": 0.5, "finish_reason": "stop", "rewards": {"math_exact": 1.0}}])
        (tmp_path / "curves.png").write_bytes(b"png")
        trackers.image(3, "curves", tmp_path / "curves.png")
        trackers.close("finished")
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 3, warnings
    assert warnings[0].startswith("wandb: could not start (ConnectionError: no route to host); this run goes on")
    assert warnings[1].startswith("mlflow: logging step 2 failed (ConnectionError: quota exceeded); this run goes on")
    assert warnings[2] == "trackio: finishing its run failed (OSError: disk full)"
    assert [s for s, _ in made["mlflow"].steps] == [1] and made["mlflow"].finished == ["failed"]
    assert [s for s, _ in made["trackio"].steps] == [1, 2, 3] and made["trackio"].finished == ["finished"]
    assert made["trackio"].steps[0][1] == {"reward/mean": 0.1}, "strings and non-finite values stay in metrics.jsonl"
    assert made["trackio"].tables == [(1, ["step", "sample", "prompt", "completion", "reward", "advantage",
                                           "finish_reason", "reward/math_exact"],
                                       [[1, 0, "1+1=", "2", 1.0, 0.5, "stop", 1.0]])]
    assert made["trackio"].images == [(3, "curves", tmp_path / "curves.png")]


def test_sample_table_has_a_column_per_reward_function():
    columns, data = sample_table([{"step": 4, "sample": 0, "rewards": {"b": 1.0, "a": None}},
                                  {"step": 4, "sample": 2, "rewards": {"a": 0.5}}])
    assert columns[-2:] == ["reward/a", "reward/b"] and [row[-2:] for row in data] == [[None, 1.0], [0.5, None]]


# ------------------------------------------------------------------ real trackers, offline


@pytest.fixture(scope="module")
def run_and_resume(tmp_path_factory):
    """A 3-step run writing to every installed tracker offline (W&B offline, SwanLab offline,
    MLflow on a local SQLite store, Trackio's local database), then ``--resume`` to 5 steps.
    Returns ``(root, out, state after the first run, the first run's rows)``."""
    if not INSTALLED:
        pytest.skip("no tracker installed (pip install 'portarl[trackers]')")
    root = tmp_path_factory.mktemp("trackers")
    out = root / "run"
    env = _env(root, WANDB_PROJECT="env-project", MLFLOW_EXPERIMENT_NAME="env-experiment")
    sets = [f"logging.trackers=[tensorboard, {', '.join(INSTALLED)}]", "train.steps=3", "checkpoint.every=1",
            "logging.samples_every=2", "logging.plot=true", *(s for name in INSTALLED for s in OFFLINE[name])]
    _train(root, out, *sets, env=env)
    from portarl.trainer.checkpoint import CheckpointManager

    first_state = CheckpointManager.load_state(CheckpointManager(out).latest())
    first_rows = _rows(out)
    _train(root, out, *sets, "train.steps=5", resume=True, env=env)
    return root, out, first_state, first_rows


def test_the_checkpoint_keeps_each_trackers_run_id(run_and_resume):
    _, out, first_state, first_rows = run_and_resume
    from portarl.trainer.checkpoint import CheckpointManager

    assert [row["step"] for row in first_rows] == [1, 2, 3]
    assert sorted(first_state["trackers"]) == sorted(INSTALLED)
    last = CheckpointManager.load_state(CheckpointManager(out).latest())
    assert last["step"] == 5 and last["trackers"] == first_state["trackers"], "the resumed run kept the same runs"
    assert [row["step"] for row in _rows(out)] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("tracker", TRACKERS)
def test_every_metric_reaches_the_tracker_at_its_step_and_the_resume_continues_its_run(run_and_resume, tracker):
    needs(tracker)
    root, out, state, _ = run_and_resume
    rows, run_id = _rows(out), state["trackers"][tracker]
    if tracker == "wandb":
        runs = tracker_readers.wandb_runs(out)
        assert list(runs) == [run_id], f"one W&B run, continued by the resume: {list(runs)}"
        run = runs[run_id]
        assert len(run["folders"]) == 2, "an offline folder per start, with the same run id (wandb sync joins them)"
        assert run["project"] == "env-project", "$WANDB_PROJECT applies where logging.wandb.project is null"
        assert run["name"] == "run" and run["tags"] == ["grpo", "tiny"]
        # the config, as the resumed start updated it (train.steps may change on --resume)
        assert run["config"]["train"]["steps"] == 5 and run["config"]["logging"]["wandb"]["mode"] == "offline"
        assert [(s, f["_type"], f["nrows"]) for s, f in run["media"]["samples"]] == [(1, "table-file", 4),
                                                                                     (2, "table-file", 4),
                                                                                     (4, "table-file", 4)]
        assert [(s, f["_type"]) for s, f in run["media"]["curves"]] == [(3, "image-file"), (5, "image-file")]
    elif tracker == "swanlab":
        runs = tracker_readers.swanlab_runs(out / "swanlog")
        assert list(runs) == [run_id], f"one SwanLab run id, continued by the resume: {list(runs)}"
        run = runs[run_id]
        assert len(run["folders"]) == 2 and run["name"] == "cfg-name" and run["project"] == "portarl"
        assert run["media"] == {"samples": [1, 2, 4], "curves": [3, 5]}
        config = (run["folders"][0] / "files" / "config.yaml").read_text()
        assert "steps:" in config and "offline" in config
    elif tracker == "mlflow":
        run = tracker_readers.mlflow_run(f"sqlite:///{root / 'mlflow.db'}", run_id)
        assert run["experiment"] == "env-experiment", "$MLFLOW_EXPERIMENT_NAME applies where the setting is null"
        assert run["status"] == "FINISHED" and run["name"] == "run"
        assert run["params"]["train.steps"] == "3", "parameters of the first start (MLflow never changes one)"
        assert run["params"]["logging.trackers"].startswith('["tensorboard"')
        assert {"samples/step-000001.json", "samples/step-000002.json", "samples/step-000004.json", "curves.png",
                "config/step-000000", "config/step-000003"} <= set(run["artifacts"]), run["artifacts"]
    else:
        runs = _trackio_runs(root, "tproj")
        assert list(runs) == [run_id] == ["run"], f"one Trackio run (resumed by its name): {list(runs)}"
        run = runs[run_id]
        assert run["media"] == {"samples": [1, 2, 4], "curves": [3, 5]}
        assert run["config"]["train"]["steps"] in (3, 5)
    _assert_every_metric(rows, run["steps"], tracker)


def test_a_tracker_failing_mid_run_costs_one_warning_and_no_tracker_leaves_a_thread_or_process(tmp_path, monkeypatch):
    """In this process (the threads and child processes are this process's): MLflow's client
    loses its server at step 2 (every call raises from then on, as with the network gone);
    W&B and SwanLab go on, and once the run ends nothing any tracker started is left."""
    for name in ("wandb", "swanlab", "mlflow"):
        needs(name)
    from mlflow.tracking import MlflowClient

    from portarl.trainer import GRPOTrainer, build_from_config
    from proc_tree import alive, children
    from trainer_fast import fast_config

    monkeypatch.chdir(tmp_path)
    for name in ("WANDB_MODE", "WANDB_PROJECT", "SWANLAB_MODE", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "XDG_CACHE_HOME"):  # W&B's own files (wandb-core's log)
        monkeypatch.setenv(name, str(tmp_path / "home" / name.lower()))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    real = MlflowClient.log_batch

    def log_batch(self, run_id, metrics=(), *args, **kwargs):
        if any(m.step >= 2 for m in metrics):
            raise ConnectionError("Max retries exceeded with url: /api/2.0/mlflow/runs/log-batch")
        return real(self, run_id, metrics, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", log_batch)
    cfg = fast_config(tmp_path, "logging.trackers=[wandb, swanlab, mlflow]", "logging.wandb.mode=offline",
                      "logging.swanlab.mode=offline", f"logging.mlflow.tracking_uri={uri}", "logging.samples_every=0")
    model, tokenizer, examples = build_from_config(cfg)
    trainer = GRPOTrainer(model, tokenizer, None, examples, cfg, device="cpu")
    threads, processes = set(threading.enumerate()), set(children(os.getpid()))
    # The trainer's logger itself, not the root's capture: a test that ran earlier in this
    # process (a library's logging set-up) may have disabled or silenced it (seen in make test).
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    train_log = logging.getLogger("portarl.train")
    monkeypatch.setattr(train_log, "disabled", False)
    monkeypatch.setattr(train_log, "level", logging.WARNING)
    train_log.addHandler(handler)
    try:
        result = trainer.train()
    finally:
        train_log.removeHandler(handler)
    trainer.close()
    assert result.steps == 3
    warned = [r.getMessage() for r in records if "mlflow" in r.getMessage()]
    assert warned == [warned[0]] and warned[0].startswith("mlflow: logging step 2 failed (ConnectionError: Max retries"), \
        warned
    out = tmp_path / "run"
    rows = _rows(out)
    assert [row["step"] for row in rows] == [1, 2, 3], "metrics.jsonl keeps every step"
    state = trainer.tracker_runs
    mlflow_run = tracker_readers.mlflow_run(uri, state["mlflow"])
    assert sorted(mlflow_run["steps"]) == [1] and mlflow_run["status"] == "FAILED"
    _assert_every_metric(rows, tracker_readers.wandb_runs(out)[state["wandb"]]["steps"], "wandb")
    _assert_every_metric(rows, tracker_readers.swanlab_runs(out / "swanlog")[state["swanlab"]]["steps"], "swanlab")
    # tqdm's monitor is transformers' (save_pretrained's bar in a checkpoint; the CLI turns those bars off)
    left = [t for t in set(threading.enumerate()) - threads if t.is_alive() and t.name != "tqdm_monitor"]
    assert not left, f"threads the trackers left running: {left}"
    started = [pid for pid in set(children(os.getpid())) - processes if alive(pid)]
    assert not started, f"processes the trackers left running: {started}"


def test_async_mode_logs_every_step_to_the_trackers(tmp_path):
    """rollout.mode=async: the steps come from the worker process; the trackers, fed by the
    trainer's loop, get them all the same (and the worker starts none of its own)."""
    needs("trackio")
    out = tmp_path / "run"
    _train(tmp_path, out, "train.steps=3", "rollout.mode=async", "rollout.max_staleness=1",
           "logging.trackers=[trackio]", "logging.samples_every=2")
    rows = _rows(out)
    assert [row["step"] for row in rows] == [1, 2, 3]
    trackio_runs = _trackio_runs(tmp_path, "portarl")
    assert list(trackio_runs) == ["run"], "one run: the worker process logs nowhere"
    _assert_every_metric(rows, trackio_runs["run"]["steps"], "trackio")
    assert trackio_runs["run"]["media"]["samples"] == [1, 2]

