"""LoRA (``model.lora``, through peft): only the adapter trains; the KL reference is the
same model with the adapter disabled (no copy); checkpoints hold the adapter only and
resume bitwise; vLLM's sync and ``portarl export`` get merged weights under the base
model's names; FSDP2 refuses it; a missing peft is one line naming the extra."""

from __future__ import annotations

import shutil
import sys

import pytest
import torch

pytest.importorskip("peft", reason="LoRA needs peft (pip install 'portarl[lora]')")

from portarl.assets.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, is_lora, merged_state_dict  # noqa: E402
from portarl.parity.tolerances import fp32_result  # noqa: E402
from portarl.trainer import build_from_config  # noqa: E402
from portarl.trainer.config import ConfigError, TrainConfig  # noqa: E402
from portarl.trainer.phases.reference import reference_model  # noqa: E402
from portarl.trainer.phases.scoring import no_grad_logprobs  # noqa: E402
from portarl.trainer.phases.sequences import build_batch  # noqa: E402

import run_guard  # noqa: E402
from trainer_fast import FAST, fast_config, varied_reward  # noqa: E402

LORA = ("model.lora.r=4", "loss.kl_coef=0.1")


def _randomize_lora_b(model, seed=0):
    """peft starts B at zero (the adapter is the identity at step 0): give it values so that
    a test comparing adapter on / off can fail."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def _adapter(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}


def _base(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" not in k}


def _assert_close(actual, expected, what):
    tol = fp32_result(float(expected.abs().max()))
    err = (actual - expected).abs()
    assert bool((err <= tol.allowed(expected)).all()), f"{what}: max error {float(err.max()):.3e}"


def _logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


# ------------------------------------------------------------------ config
def test_lora_config_defaults_and_errors_name_the_field():
    assert TrainConfig.load(None, []).model.lora is None  # off by default
    lora = TrainConfig.load(None, ["model.lora.r=8"]).model.lora
    assert (lora.r, lora.alpha, lora.dropout) == (8, 16.0, 0.0)  # alpha defaults to 2 x r
    assert "q_proj" in lora.target_modules and "down_proj" in lora.target_modules
    assert TrainConfig.load(None, ["model.lora.target_modules=all-linear"]).model.lora.target_modules == "all-linear"
    again = TrainConfig.from_dict(TrainConfig.load(None, ["model.lora.r=8"]).to_dict()).model.lora
    assert again == lora  # round trip through config.yaml
    for bad, field in (("model.lora.r=0", "model.lora.r"), ("model.lora.alpha=-2", "model.lora.alpha"),
                       ("model.lora.dropout=1", "model.lora.dropout"), ("model.lora.target_modules=[]",
                       "model.lora.target_modules"), ("model.lora.rank=4", "model.lora.rank"),
                       ("model.lora=3", "model.lora")):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            TrainConfig.load(None, [bad])


def test_lora_passes_the_distributed_checks():
    """LoRA runs under FSDP2, colocated and async (tests/distributed/test_torchrun_options.py
    and test_async_torchrun.py train it on 2 ranks)."""
    from portarl.trainer.start.setup import check_distributed_config

    for mode in ("colocated", "async"):
        check_distributed_config(TrainConfig.load(None, [*FAST, "model.lora.r=4", f"rollout.mode={mode}"]), 2)


def test_missing_peft_is_one_line_naming_the_extra(monkeypatch, tmp_path, capsys):
    from portarl import cli

    monkeypatch.setitem(sys.modules, "peft", None)  # import peft -> ImportError
    code = cli.main(["train", "--device", "cpu", "--output-dir", str(tmp_path / "run"), "--set", "model.lora.r=4"])
    err = capsys.readouterr().err
    assert code == 2
    assert "pip install 'portarl[lora]'" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_unknown_target_module_names_the_field(make_trainer):
    with pytest.raises(ValueError, match=r"model\.lora\.target_modules"):
        make_trainer("model.lora.target_modules=[no_such_proj]")


# ------------------------------------------------------------------ model and optimizer
def test_only_adapter_is_trained_with_fp32_masters_in_bf16(make_trainer):
    trainer = make_trainer(*LORA, "precision.dtype=bf16", "train.steps=1", rewards=[varied_reward])
    assert is_lora(trainer.model)
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert trainer.param_names == trainable
    total = sum(p.numel() for p in trainer.model.parameters())
    opt = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    assert sum(p.numel() for p in opt) == sum(p.numel() for p in trainer.model.parameters() if p.requires_grad) < total
    assert all(p.dtype == torch.float32 for p in opt)  # fp32 masters of the bf16 adapter
    assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())
    base = _base(trainer.model)
    before = _adapter(trainer.model)
    metrics = trainer.train_step()
    assert metrics["skipped"] == 0
    after = trainer.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items()), "a base weight changed"
    assert any(not torch.equal(after[k], v) for k, v in before.items()), "the adapter did not move"


def test_reference_is_the_base_model_with_the_adapter_disabled(make_trainer):
    trainer = make_trainer(*LORA, rewards=[varied_reward])
    _randomize_lora_b(trainer.model)
    plain, _, _ = build_from_config(trainer.config)  # the base model, built the same way, no adapter
    cfg = trainer.config
    batch = build_batch([[5, 6, 7, 8], [9, 10, 11]], [[12, 13, 2], [14, 15, 16]], trainer.codec.pad_token_id,
                        trainer.device)
    with reference_model(trainer) as ref:
        assert ref is trainer.model  # no copy
        ref_logp = no_grad_logprobs(trainer, ref, batch)
    base_logp = no_grad_logprobs(trainer, plain.to(dtype=torch.float32), batch)
    policy_logp = no_grad_logprobs(trainer, trainer.model, batch)  # the adapter is back on
    mask = batch.mask
    _assert_close(ref_logp[mask], base_logp[mask], "ref_logp vs the base model")
    assert not torch.allclose(policy_logp[mask], ref_logp[mask]), "the adapter changed nothing: the test cannot fail"
    params_before = sum(p.numel() for p in trainer.model.parameters())
    trainer.train()  # kl_coef > 0: the reference is used every step
    assert trainer.ref_model is None and trainer.make_reference() is None
    assert sum(p.numel() for p in trainer.model.parameters()) == params_before
    assert cfg.loss.kl_coef > 0


# ------------------------------------------------------------------ checkpoints and resume
@pytest.mark.compares_runs
def test_checkpoint_holds_the_adapter_only_and_resume_is_bitwise(tmp_path):
    from portarl.trainer import GRPOTrainer
    from portarl.trainer.checkpoint import CheckpointManager

    def make(out, steps):
        cfg = fast_config(tmp_path, *LORA, f"output_dir={tmp_path / out}", f"train.steps={steps}",
                          "checkpoint.every=1", "checkpoint.keep_last=3")
        model, tok, examples = build_from_config(cfg)
        return GRPOTrainer(model, tok, [varied_reward], examples, cfg, device="cpu")

    straight = make("straight", 3)
    base0 = _base(straight.model)
    straight.train()
    run_guard.assert_run_trained(straight.output_dir, what="the uninterrupted LoRA run")
    assert all(torch.equal(straight.model.state_dict()[k], v) for k, v in base0.items()), "a base weight changed"

    first = make("resumed", 2)
    first.train()
    ckpt = CheckpointManager(first.output_dir).latest()
    names = {p.name for p in ckpt.iterdir()}
    assert {ADAPTER_WEIGHTS, ADAPTER_CONFIG} <= names and "model.safetensors" not in names
    from safetensors.torch import load_file

    saved = load_file(str(ckpt / ADAPTER_WEIGHTS))
    assert saved and all("lora_" in k for k in saved)
    base_bytes = sum(v.numel() * v.element_size() for v in base0.values())
    assert (ckpt / ADAPTER_WEIGHTS).stat().st_size < base_bytes / 2
    adapter_at_2, optim_at_2 = _adapter(first.model), first.optimizer.state_dict()

    second = make("resumed", 3)
    assert second.resume() == 2
    assert all(torch.equal(second.model.state_dict()[k], v) for k, v in adapter_at_2.items())
    got = second.optimizer.state_dict()["state"]
    for i, want in optim_at_2["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(got[i][key], want[key]), f"optimizer state {i}.{key} differs after resume"
    second.train(resume=True)
    run_guard.assert_run_trained(second.output_dir, what="the resumed LoRA run")
    final, expected = _adapter(second.model), _adapter(straight.model)
    for k, v in expected.items():
        assert torch.equal(final[k], v), f"{k}: resumed run differs from the uninterrupted one"
    assert all(torch.equal(second.model.state_dict()[k], v) for k, v in base0.items())


# ------------------------------------------------------------------ merged weights: vLLM sync
def test_merged_state_dict_has_base_names_and_the_peft_logits(make_trainer):
    trainer = make_trainer(*LORA)
    _randomize_lora_b(trainer.model)
    plain, _, _ = build_from_config(trainer.config)
    merged = merged_state_dict(trainer.model)
    assert sorted(merged) == sorted(plain.state_dict())
    before = _base(trainer.model)
    plain.load_state_dict(merged)
    ids = torch.randint(3, 60, (3, 10), generator=torch.Generator().manual_seed(1))
    _assert_close(_logits(plain, ids), _logits(trainer.model, ids), "merged model vs peft model")
    after = trainer.model.state_dict()  # the training model was not merged in place
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_vllm_sync_sends_merged_weights_under_base_names(make_trainer):
    from portarl.rollout import vllm_sync
    from portarl.rollout.vllm import VLLMRollout

    trainer = make_trainer(*LORA)
    _randomize_lora_b(trainer.model)

    class FakeLLM:
        def collective_rpc(self, method, kwargs):
            self.sent = dict(kwargs["weights_iterator"])

        def reset_prefix_cache(self):
            pass

    engine = object.__new__(VLLMRollout)  # no vLLM here: the sync path only
    engine.llm, engine.sleep_level, engine._asleep, engine.weights_version = FakeLLM(), 0, False, 0
    engine.sync_path = vllm_sync.RELOAD  # what start-up chooses for a worker with reload_weights
    engine.sync_weights(trainer.model)
    merged = merged_state_dict(trainer.model)
    plain, _, _ = build_from_config(trainer.config)
    assert set(engine.llm.sent) == set(plain.state_dict()) - {"lm_head.weight"}  # tied head: vLLM ties it
    for name, tensor in engine.llm.sent.items():
        assert torch.equal(tensor, merged[name])
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(engine.llm.sent[q], plain.state_dict()[q])  # the adapter is in it


# ------------------------------------------------------------------ portarl export
def test_export_writes_a_merged_hf_model_with_the_trained_logits(make_trainer, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from portarl import cli

    trainer = make_trainer(*LORA, "train.steps=2", rewards=[varied_reward])
    trainer.train()
    out = tmp_path / "exported"
    assert cli.main(["export", "--checkpoint", str(trainer.output_dir), "--out", str(out)]) == 0
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert not (out / ADAPTER_WEIGHTS).exists()
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    ids = torch.randint(3, 60, (3, 10), generator=torch.Generator().manual_seed(2))
    _assert_close(_logits(loaded, ids), _logits(trainer.model, ids), "exported model vs trained peft model")
    from portarl.assets.models import load_local

    _, tokenizer = load_local(out)  # the tokenizer came along
    assert len(tokenizer) == len(trainer.tokenizer)

    capsys.readouterr()
    assert cli.main(["export", "--checkpoint", str(trainer.output_dir), "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert cli.main(["export", "--checkpoint", str(trainer.output_dir), "--out", str(out), "--overwrite"]) == 0
    assert cli.main(["export", "--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err
    ckpt = sorted((trainer.output_dir / "checkpoints").glob("step-*"))[-1]
    torn = tmp_path / "torn"
    shutil.copytree(ckpt, torn)
    (torn / "COMPLETE").unlink()
    assert cli.main(["export", "--checkpoint", str(torn), "--out", str(tmp_path / "y")]) == 2
    assert "incomplete" in capsys.readouterr().err
    (ckpt / ADAPTER_WEIGHTS).write_bytes(b"damaged")
    assert cli.main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "z")]) == 2
    assert ADAPTER_WEIGHTS in capsys.readouterr().err
    assert not (tmp_path / "z").exists()


def test_export_of_a_full_model_checkpoint(make_trainer, tmp_path):
    from transformers import AutoModelForCausalLM

    from portarl.trainer.checkpoint.export import export_checkpoint

    trainer = make_trainer("train.steps=1", rewards=[varied_reward])
    trainer.train()
    out = export_checkpoint(trainer.checkpoints.latest(), tmp_path / "full")
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    ids = torch.randint(3, 60, (2, 8), generator=torch.Generator().manual_seed(3))
    assert torch.equal(_logits(loaded, ids), _logits(trainer.model, ids))


def test_portarl_sft_with_lora_saves_a_merged_model(tmp_path):
    from safetensors.torch import load_file

    from portarl import cli
    from portarl.assets.models import load_local

    sets = [x for item in FAST for x in ("--set", item)]
    out = tmp_path / "sft"
    assert cli.main(["sft", "--device", "cpu", "--output-dir", str(out), *sets, "--set", "model.lora.r=4",
                     "--set", "train.sft_batch_size=8", "--steps", "2"]) == 0
    plain, _, _ = build_from_config(fast_config(tmp_path))
    saved = load_file(str(out / "sft-model" / "model.safetensors"))
    assert set(saved) <= set(plain.state_dict()) and not any("lora_" in k for k in saved)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(saved[q], plain.state_dict()[q])  # the trained adapter is merged in
    e = "model.embed_tokens.weight"
    assert torch.equal(saved[e], plain.state_dict()[e])  # not a LoRA target: the base weight
    load_local(out / "sft-model")


def test_a_model_wrapped_by_the_caller_is_refused(tmp_path):
    from portarl.assets.lora import apply_lora
    from portarl.trainer import GRPOTrainer

    cfg = fast_config(tmp_path, *LORA)
    model, tok, examples = build_from_config(cfg)
    with pytest.raises(ValueError, match="pass the base model and set model.lora"):
        GRPOTrainer(apply_lora(model, cfg.model.lora), tok, None, examples, cfg, device="cpu")


@pytest.mark.compares_runs
def test_bf16_lora_resume_restores_masters_bitwise(make_trainer):
    trainer = make_trainer(*LORA, "precision.dtype=bf16", "train.steps=1", rewards=[varied_reward])
    trainer.train()
    # the saved adapter moved (else a resume that restored nothing would hold the same start)
    run_guard.assert_run_trained(trainer.output_dir, what="the bf16 LoRA run that saved")
    masters = [m.detach().clone() for m in trainer.precision.masters]
    adapter = _adapter(trainer.model)
    again = make_trainer(*LORA, "precision.dtype=bf16", "train.steps=2", rewards=[varied_reward])
    assert again.resume() == 1
    assert len(again.precision.masters) == len(masters) == len(adapter)
    assert all(torch.equal(a, b) for a, b in zip(again.precision.masters, masters))
    assert all(m.dtype == torch.float32 for m in again.precision.masters)
    got = _adapter(again.model)
    assert all(torch.equal(got[k], v) for k, v in adapter.items())
    opt = [p for g in again.optimizer.param_groups for p in g["params"]]
    assert all(p is m for p, m in zip(opt, again.precision.masters))  # the optimizer steps the restored masters


def test_adapters_on_embeddings_or_head_are_refused(make_trainer):
    for target in ("embed_tokens", "lm_head"):
        with pytest.raises(ValueError, match="linear layers only"):
            make_trainer(f"model.lora.target_modules=[q_proj,{target}]")


def test_merged_bf16_weights_are_summed_in_fp32(make_trainer):
    trainer = make_trainer(*LORA, "precision.dtype=bf16")
    _randomize_lora_b(trainer.model)
    merged = merged_state_dict(trainer.model)
    layer = trainer.model.get_base_model().model.layers[0].self_attn.q_proj
    w, a, b = layer.base_layer.weight, layer.lora_A["default"].weight, layer.lora_B["default"].weight
    expected = (w.float() + (b.float() @ a.float()) * layer.scaling["default"]).to(torch.bfloat16)
    got = merged["model.layers.0.self_attn.q_proj.weight"]
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expected)  # one rounding, of the fp32 sum (not of a bf16 delta first)
    rounded_first = (w.float() + ((b @ a) * layer.scaling["default"]).float()).to(torch.bfloat16)
    assert not torch.equal(rounded_first, expected), "bf16 and fp32 deltas agree here: the test cannot fail"


def test_cli_resume_continues_a_lora_run_and_refuses_a_changed_rank(tmp_path, capsys):
    from portarl import cli

    sets = [x for item in FAST for x in ("--set", item)]
    out = tmp_path / "run"
    base = ["train", "--device", "cpu", "--output-dir", str(out), *sets, "--set", "model.lora.r=4"]
    assert cli.main([*base, "--steps", "1"]) == 0
    capsys.readouterr()
    assert cli.main([*base, "--steps", "2", "--resume", "--set", "model.lora.r=8"]) == 2
    assert "model.lora.r: 4 -> 8" in capsys.readouterr().err
    assert cli.main([*base, "--steps", "2", "--resume"]) == 0
    assert (out / "checkpoints" / "step-000002" / ADAPTER_WEIGHTS).is_file()
