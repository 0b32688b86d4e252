"""Orchestration: train the settings (one process each), record or replay rollouts, and
compare run directories made on any machines.

One machine: ``run_stability(specs, replay=True)`` records the first run's rollouts and
replays them to the others. Two machines: the GPU host runs one setting with
``replay=True`` and leaves its directory; the NPU host runs ``replay_from=that directory``
(same start model, config, data order, seeds; refused otherwise); ``compare`` reads both.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import yaml

from portarl.bench.stability import analysis as _analysis
from portarl.bench.stability.archive import open_record
from portarl.bench.stability.record import (CONFIG, FORMAT, ROLLOUTS, START_MODEL, check_replay, load_directory,
                                            load_run, read_manifest, write_json)
from portarl.bench.stability.report import plot, plot_tokens, write_report
from portarl.bench.stability.runs import RunSpec
from portarl.bench.stability.worker import launch
from portarl.rollout.replay import load_rollouts


def _shared_start_model(config_path, overrides: list[str], path: Path, progress) -> None:
    """Every run starts from the same weights: the config's model after its supervised
    warm-up, done once in fp32 on the CPU (as GPU/NPU comparisons start from one checkpoint)."""
    from portarl.assets.models import save_local
    from portarl.trainer import TrainConfig, build_from_config
    from portarl.vision.codec import codec_for
    from portarl.trainer.phases.sft import run_sft

    config = TrainConfig.load(config_path, [*overrides, "device=cpu"])
    model, tokenizer, examples = build_from_config(config)
    if config.train.sft_warmup_steps:
        if progress:
            progress(f"shared start: {config.train.sft_warmup_steps} supervised warm-up steps (fp32, cpu)")
        run_sft(model, codec_for(tokenizer, model), examples, steps=config.train.sft_warmup_steps,
                batch_size=config.train.sft_batch_size, lr=config.train.sft_lr, device="cpu", seed=config.train.seed)
    save_local(model, tokenizer, path)


def _finish(results, out_dir: Path, threshold: float, steps: int) -> tuple[dict, Path]:
    import json

    analysis = _analysis.analyse(results, threshold)
    figure = plot(results, out_dir / "stability.png")
    token_figure = plot_tokens(analysis, out_dir / "tokens.png")
    (out_dir / "stability.json").write_text(json.dumps(analysis, indent=1, default=str) + "\n")
    return analysis, write_report(analysis, out_dir, figure, token_figure, steps)


def run_stability(
    specs: list[RunSpec],
    *,
    steps: int | None = None,
    seed: int = 0,
    config_path: str | None = None,
    overrides: list[str] | None = None,
    out_dir: str | Path = "runs/bench/stability",
    replay: bool = False,
    replay_from: str | Path | None = None,
    noise_floor: bool = False,
    threshold: float = 0.1,
    progress: Callable[[str], None] | None = None,
) -> tuple[dict, Path]:
    """Train ``specs`` into ``out_dir``; ``replay_from`` is a recording's directory or a
    ``.tar`` of one (:func:`.archive.pack_record`), extracted for the duration of the runs."""
    kwargs = dict(steps=steps, seed=seed, config_path=config_path, overrides=overrides, out_dir=out_dir, replay=replay,
                  noise_floor=noise_floor, threshold=threshold, progress=progress)
    if replay_from is None:
        return _run_stability(specs, replay_from=None, **kwargs)
    with open_record(replay_from) as source:  # a directory as it is, a .tar extracted
        return _run_stability(specs, replay_from=source, origin=str(Path(replay_from).resolve()), **kwargs)


def _run_stability(specs, *, steps, seed, config_path, overrides, out_dir, replay, replay_from, noise_floor, threshold,
                   progress, origin: str | None = None) -> tuple[dict, Path]:
    """``origin``: what ``replay_from`` came from (the directory, or the .tar extracted into
    it), the name the refusals and the manifest give."""
    from portarl.trainer import TrainConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    overrides = list(overrides or [])
    # The config's own directory: its module:function rewards live there (the runs read a copy of the config).
    code_dirs = [str(Path(config_path).resolve().parent)] if config_path is not None else []
    source = None
    if replay_from is not None:
        source = Path(replay_from).resolve()
        manifest = read_manifest(source)
        if not manifest.get("recording") or not (source / ROLLOUTS).exists():
            raise FileNotFoundError(f"{origin} holds no recorded rollouts: record with --replay-rollouts")
        steps = steps or manifest["steps"]
        recorder = load_run(source / "runs" / manifest["recording"]["slug"])
        config_path, start = source / CONFIG, source / START_MODEL
        rollouts = source / ROLLOUTS
        load_rollouts(rollouts)  # refuses a pickle (or a damaged file) here, before any run starts
        run_overrides = [f"model.path={start}", *overrides, f"train.steps={steps}", f"train.seed={seed}"]
        for spec in specs:  # refuse before anything trains
            here = TrainConfig.load(config_path, [*run_overrides, *spec.overrides()]).to_dict()
            check_replay(recorder_config(source, recorder), here, [*recorder.spec.settings, *spec.settings],
                         manifest["steps"], steps, origin)
    else:
        steps = steps or 100
        base = [*overrides, f"train.steps={steps}", f"train.seed={seed}", "guards.max_consecutive_skips=1000000"]
        start = (out_dir / START_MODEL).resolve()
        _shared_start_model(config_path, base, start, progress)
        shared = TrainConfig.load(config_path, [*base, f"model.path={start}", "train.sft_warmup_steps=0"]).to_dict()
        shared["model"]["path"] = START_MODEL  # relative: the directory travels to other machines
        (out_dir / CONFIG).write_text(yaml.safe_dump(shared, sort_keys=False))
        config_path, rollouts = out_dir / CONFIG, out_dir / ROLLOUTS
        run_overrides = [f"model.path={start}"]
        for spec in specs:  # surface config errors before anything trains
            TrainConfig.load(config_path, [*run_overrides, *spec.overrides()])
    all_specs = list(specs) + ([specs[0].as_noise()] if noise_floor else [])
    manifest = {"format": FORMAT, "steps": steps, "seed": seed, "threshold": threshold, "code_dirs": code_dirs,
                "runs": [{"label": s.label, "slug": s.slug} for s in all_specs],
                "recording": {"label": specs[0].label, "slug": specs[0].slug} if replay and source is None else None,
                "replayed_from": origin if source else None}
    write_json(out_dir / "manifest.json", manifest)
    results = []
    for i, spec in enumerate(all_specs):
        if progress:
            progress(f"[{i + 1}/{len(all_specs)}] training {spec.label}" + (" (EMULATION)" if spec.emulated else "")
                     + (" (noise floor: train.seed+1, own rollouts)" if spec.role == "noise" else ""))
        run_dir = out_dir / "runs" / spec.slug
        shutil.rmtree(run_dir, ignore_errors=True)
        job = {"label": spec.label, "config": str(config_path), "run_dir": str(run_dir), "code_dirs": code_dirs,
               "overrides": [*run_overrides, f"train.seed={seed + 1}"] if spec.role == "noise" else run_overrides}
        if spec.role != "noise":
            if source is not None or (replay and i > 0):
                job["replay"] = str(rollouts)
            elif replay and i == 0:
                job["record"] = str(rollouts)
        crashed = None
        if job.get("replay") and not Path(job["replay"]).exists():
            crashed = "not run: the recording run left no rollouts"
            run_dir.mkdir(parents=True, exist_ok=True)
            write_json(run_dir / "run.json", {"label": spec.label, "steps": steps, "crashed": crashed, "environment": {}})
        else:
            crashed = launch(job, out_dir / "runs" / f"{spec.slug}.job.json")
        if crashed and progress:
            progress(f"    {spec.label}: {crashed}")
        results.append(load_run(run_dir, source=str(out_dir)))
    return _finish(results, out_dir, threshold, steps)


def recorder_config(source: Path, recorder) -> dict:
    import json

    return json.loads((source / "runs" / recorder.spec.slug / "run.json").read_text())["config"]


def compare(dirs: list[str | Path], out_dir: str | Path, threshold: float = 0.1) -> tuple[dict, Path]:
    """One report over run directories made anywhere (the first directory's first run is the
    baseline); each may be a ``.tar`` of one (extracted to a temporary folder, removed after)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for d in dirs:
        with open_record(d) as directory:
            loaded = load_directory(directory)  # everything read into memory (tokens too)
        for r in loaded:
            r.source = str(Path(d))
        results += loaded
    seen: dict[str, int] = {}
    for r in results:
        seen[r.label] = seen.get(r.label, 0) + 1
    for r in results:
        if seen[r.spec.label] > 1:
            r.alias = f"{r.spec.label} ({Path(r.source).name})"
    steps = max((r.steps for r in results), default=0)
    return _finish(results, out_dir, threshold, steps)
