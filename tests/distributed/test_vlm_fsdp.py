"""Vision-language GRPO under torchrun (issue 47): a tiny Qwen-VL on 2 Gloo ranks (FSDP2)
against 1 process on the same global batch, with the tolerances of test_fsdp_gloo.py.

The data make the sharded forward carry every vision input: prompts of other lengths (an
image of 4 tokens, one of 8, two images in one prompt) and a text-only prompt, whose group
is a micro-batch without pixels on its rank while the other rank's has pixels (the vision
tower is in FSDP2's root unit, so the ranks gather the same parameters either way:
portarl.runtime.distributed.shard). The vision tower is frozen and its projector trains
(the example's setting), and the KL term keeps a sharded reference copy."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

from test_fsdp_gloo import ATOL, PARAM_ATOL, RTOL, _env, _rows, assert_params_close, assert_trained  # noqa: E402

from portarl.runtime.distributed import local_launcher  # noqa: E402
from portarl.trainer.checkpoint import CheckpointManager  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vlm-colours.yaml"
LR = 1e-2
assert PARAM_ATOL == 1e-3 * LR, "PARAM_ATOL of test_fsdp_gloo.py bounds one AdamW step at this lr"
FAST = [
    "train.prompts_per_step=4", "train.sft_warmup_steps=0", "train.micro_batch_size=4", "rollout.group_size=4",
    "rollout.max_new_tokens=3", "logging.progress=false", "logging.tensorboard=false", "logging.plot=false",
    f"optim.lr={LR}", "loss.kl_coef=0.05", "checkpoint.every=1", "eval.data=null",
    # Unshared rows, as in test_fsdp_gloo.py: shared-prompt rows are composed from each rank's
    # own groups, so one process and two ranks would multiply matrices of other shapes.
    "train.share_prompt=false", "rewards=[{name: 'dist_rewards:length_and_digits'}]",
]

#: (prompt text, image sizes): 4 image tokens, 8, none, 4 + 9 (tiny processors: 28 x 28 pixels a token).
ROWS = [("Which colour is the square?", [(56, 56)]), ("Name the colour of the wide picture, please.", [(112, 56)]),
        ("Say a colour.", []), ("Do these two pictures share a colour?", [(56, 56), (84, 84)])]


def _data(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    colours = [(200, 30, 30), (30, 160, 30), (30, 30, 200), (220, 200, 20), (120, 120, 120)]
    with (directory / "rows.jsonl").open("w") as f:
        for i, (text, sizes) in enumerate(ROWS):
            names = []
            for j, size in enumerate(sizes):
                names.append(f"img_{i}_{j}.png")
                Image.new("RGB", size, colours[(i + j) % len(colours)]).save(directory / names[-1])
            content = [{"type": "image"} for _ in sizes] + [{"type": "text", "text": text}]
            f.write(json.dumps({"prompt": [{"role": "user", "content": content}], "images": names,
                                "answer": "red"}) + "\n")
    return directory / "rows.jsonl"


def _train(out: Path, ranks: int, data: Path, *sets: str, resume: bool = False):
    import subprocess

    launcher = [*local_launcher(ranks), "-m", "portarl"] if ranks > 1 else [sys.executable, "-m", "portarl"]
    cmd = [*launcher, "train", "--config", str(EXAMPLE), "--device", "cpu", "--output-dir", str(out)]
    for item in (*FAST, f"data.path={data}", *sets):
        cmd += ["--set", item]
    if resume:
        cmd.append("--resume")
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)


def _model(name: str):
    """The run's initial model, as the trainer builds it (tower frozen, projector trained)."""
    from portarl.vision.models import build_tiny_vlm, freeze_vision

    model, _ = build_tiny_vlm(name, seed=0)
    freeze_vision(model, train_projector=True)
    return model


def _params(name: str, directory: Path | None = None) -> dict[str, torch.Tensor]:
    """Parameters of a checkpoint (sharded or not) loaded in this process; the initial ones without."""
    model = _model(name)
    if directory is not None and CheckpointManager.is_sharded(directory):
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
        CheckpointManager.load_sharded(directory, model, optimizer)
    elif directory is not None:
        CheckpointManager.load_weights(model, directory)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _grpo(out: Path) -> list[dict]:
    return [row for row in _rows(out) if row.get("phase") == "grpo"]


@pytest.fixture(scope="module", params=[
    pytest.param(("tiny-qwen2.5-vl", "true"), id="qwen2.5-vl-padding-free"),
    pytest.param(("tiny-qwen2.5-vl", "false"), id="qwen2.5-vl-padded"),
    pytest.param(("tiny-qwen3-vl", "true"), id="qwen3-vl-padding-free"),
])
def one_and_two(request, tmp_path_factory):
    name, padding_free = request.param
    root = tmp_path_factory.mktemp("vlm-dp")
    data = _data(root / "data")
    single, double = root / "single", root / "double"
    for out, ranks in ((single, 1), (double, 2)):
        proc = _train(out, ranks, data, "train.steps=1", f"model.path={name}", f"train.padding_free={padding_free}")
        assert proc.returncode == 0, proc.stderr[-4000:]
    return name, data, single, double, f"train.padding_free={padding_free}"


@pytest.mark.compares_runs
def test_one_vlm_step_on_two_ranks_matches_one_process(one_and_two):
    name, _, single, double, _ = one_and_two
    assert_trained(single, double)
    a, b = _grpo(single)[0], _grpo(double)[0]
    assert a["reward/mean"] == b["reward/mean"], "both runs must roll out the same completions"
    for key in ("loss", "pg/loss", "kl/loss", "grad_norm", "entropy"):
        assert b[key] == pytest.approx(a[key], rel=RTOL, abs=ATOL), key
    start = _params(name)
    pa, pb = _params(name, CheckpointManager(single).latest()), _params(name, CheckpointManager(double).latest())
    assert_params_close(pa, pb)
    tower = [k for k in start if ".visual." in k and "merger" not in k]
    assert tower and all(torch.equal(pb[k], start[k]) for k in tower), "the frozen tower must not move"
    assert any(not torch.equal(pb[k], start[k]) for k in start if ".merger." in k), "the projector trains"


def test_a_two_rank_vlm_checkpoint_resumes_on_one_process(one_and_two, tmp_path):
    """The DCP shards (optimizer state over the trainable parameters only) load into one
    process, which trains on from them."""
    import shutil

    name, data, _, double, layout = one_and_two
    run = tmp_path / "run"
    shutil.copytree(double, run)
    proc = _train(run, 1, data, "train.steps=2", f"model.path={name}", layout, resume=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["step"] for r in _grpo(run)] == [1, 2]
    latest = CheckpointManager(run).latest()
    assert not CheckpointManager.is_sharded(latest) and CheckpointManager.load_state(latest)["step"] == 2
