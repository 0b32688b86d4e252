"""optim.implementation: foreach / fused AdamW give the per-parameter loop's results within
fp32 rounding, in isolation and through the trainer, and a checkpoint written by one
implementation resumes in another (the configured flags win, ``step`` moves where that
implementation reads it)."""

from __future__ import annotations

import types

import pytest
import torch

from portarl.parity.tolerances import fp32_result
from portarl.trainer.config import ConfigError
from portarl.trainer.phases.optimizer import make_adamw, resolve_implementation

import run_guard
from trainer_fast import fast_config, varied_reward


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    tol = fp32_result(float(want.abs().max()))
    err = float((got - want).abs().max())
    assert err <= tol.atol, f"{what}: max |diff| {err:.3g} > {tol.atol:.3g}"


def _run(impl: str, steps: int = 6) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=gen).requires_grad_(True) for shape in [(7, 5), (5,), (3, 4, 2), (1,)]]
    opt = make_adamw(params, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, implementation=impl)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_implementations_match_the_per_parameter_loop(impl):
    for i, (got, want) in enumerate(zip(_run(impl), _run("single"))):
        _assert_close(got, want, f"{impl} param {i}")


def test_auto_resolves_by_device_and_fused_is_refused_where_torch_has_none(tmp_path):
    assert resolve_implementation("auto", torch.device("cpu")) == "fused"
    assert resolve_implementation("auto", torch.device("cuda")) == "fused"
    assert resolve_implementation("auto", torch.device("cpu"), sharded=True) == "foreach"  # FSDP2 DTensors
    assert resolve_implementation("auto", types.SimpleNamespace(type="npu")) == "foreach"
    with pytest.raises(ValueError, match="optim.implementation=fused: torch_npu .*auto or foreach"):
        resolve_implementation("fused", types.SimpleNamespace(type="npu"))  # no torch_npu here
    with pytest.raises(ValueError, match="optim.implementation=fused.*'meta'"):
        resolve_implementation("fused", torch.device("meta"))
    with pytest.raises(ConfigError, match="optim.implementation"):
        fast_config(tmp_path, "optim.implementation=fast")


def _trainer(tmp_path, name: str, *overrides: str):
    from portarl.trainer import GRPOTrainer, build_from_config

    cfg = fast_config(tmp_path / name, *overrides)
    model, tokenizer, examples = build_from_config(cfg)
    return GRPOTrainer(model, tokenizer, [varied_reward], examples, cfg, device="cpu")


def _weights(trainer) -> dict:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.compares_runs
def test_trainer_steps_equal_across_implementations(tmp_path):
    runs = {}
    for impl in ("single", "foreach"):
        trainer = _trainer(tmp_path, impl, f"optim.implementation={impl}")
        assert trainer.optimizer.param_groups[0]["foreach"] is (impl == "foreach")
        start = _weights(trainer)
        norms = [trainer.train_step()["grad_norm"] for _ in range(2)]
        runs[impl] = dict(trainer.model.named_parameters())
        run_guard.assert_trained(norms, start, _weights(trainer), what=f"2 steps with optim.implementation={impl}")
    for name, p in runs["single"].items():
        _assert_close(runs["foreach"][name].detach(), p.detach(), name)


@pytest.mark.compares_runs
@pytest.mark.parametrize("saved, resumed", [("foreach", "single"), ("single", "fused"), ("fused", "foreach")])
def test_checkpoint_resumes_in_another_implementation(tmp_path, saved, resumed):
    writer = _trainer(tmp_path, "run", f"optim.implementation={saved}")
    start = _weights(writer)
    norms = [writer.train_step()["grad_norm"]]
    writer.save_checkpoint()
    norms.append(writer.train_step()["grad_norm"])  # the step a resumed run must reproduce
    expected = {n: p.detach().clone() for n, p in writer.model.named_parameters()}
    run_guard.assert_trained(norms, start, expected, what=f"the optim.implementation={saved} run that saved")

    reader = _trainer(tmp_path, "run", f"optim.implementation={resumed}")
    assert reader.resume() == 1
    group = reader.optimizer.param_groups[0]
    assert (group["foreach"], group["fused"]) == (resumed == "foreach", resumed == "fused")
    steps = [s["step"] for s in reader.optimizer.state.values()]
    assert steps and all(s.dtype == torch.float32 and s.device.type == "cpu" for s in steps)
    resumed_from = _weights(reader)
    norm = reader.train_step()["grad_norm"]
    run_guard.assert_trained([norm], resumed_from, _weights(reader), what=f"the step resumed with {resumed}")
    for name, p in reader.model.named_parameters():
        _assert_close(p.detach(), expected[name], name)
