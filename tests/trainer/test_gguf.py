"""`model.path` as a .gguf file: transformers' GGUF loader, dequantised to the configured
dtype, the tokenizer and chat template from the file (issue 16 item 5). The file is
written here with the gguf package's own writer; nothing is downloaded."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf", reason="GGUF loading needs the gguf package (pip install 'portarl[gguf]')")

from gguf_tiny import write_tiny_gguf  # noqa: E402
from portarl.assets.models import load_local  # noqa: E402
from portarl.assets.tokenizer import as_codec  # noqa: E402
from trainer_fast import fast_config  # noqa: E402


def test_gguf_loads_dequantised_with_its_tokenizer(tmp_path):
    written = write_tiny_gguf(tmp_path / "tiny.gguf")
    model, tok = load_local(tmp_path / "tiny.gguf", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    state = model.state_dict()
    # the Q8_0 tensor comes back as its dequantised values; plain ones as written
    for gguf_name, hf_name in [("blk.0.ffn_up.weight", "model.layers.0.mlp.up_proj.weight"),
                               ("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight"),
                               ("token_embd.weight", "model.embed_tokens.weight")]:
        assert torch.equal(state[hf_name], torch.from_numpy(written[gguf_name]).to(torch.bfloat16)), hf_name
    codec = as_codec(tok)
    assert tok.decode(tok("What is 2+3?")["input_ids"]) == "What is 2+3?"
    assert codec.stop_token_ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    ids = codec.encode_prompt(({"role": "user", "content": "2+3?"},))
    assert tok.convert_ids_to_tokens(ids)[:1] == ["<|im_start|>"]


def test_training_from_a_gguf_file(tmp_path):
    from portarl.trainer import GRPOTrainer, build_from_config

    write_tiny_gguf(tmp_path / "tiny.gguf")
    data = tmp_path / "q.jsonl"
    data.write_text("".join('{"prompt": [{"role": "user", "content": "What is %d+1?"}], "answer": "%d"}\n' % (i, i + 1)
                            for i in range(4)))
    cfg = fast_config(tmp_path, f"model.path={tmp_path / 'tiny.gguf'}", f"data.path={data}", "train.steps=1",
                      "model.hidden_size=32")
    model, tok, examples = build_from_config(cfg)
    trainer = GRPOTrainer(model, tok, None, examples, cfg, device="cpu")
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    with pytest.raises(FileNotFoundError, match="not a file"):
        load_local(tmp_path / "missing.gguf")


def test_cli_trains_from_a_gguf_file_and_names_a_missing_one(tmp_path):
    """What the example does: ``portarl train`` with model.path a .gguf file (the CLI's model
    check once refused anything but a directory), and a one-line error for a missing file."""
    import os
    import subprocess
    import sys

    write_tiny_gguf(tmp_path / "tiny.gguf")
    data = tmp_path / "q.jsonl"
    data.write_text("".join('{"prompt": [{"role": "user", "content": "What is %d+1?"}], "answer": "%d"}\n' % (i, i + 1)
                            for i in range(4)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    sets = ["train.steps=1", "train.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=3",
            "train.sft_warmup_steps=0", "logging.progress=false", "logging.tensorboard=false", "logging.plot=false",
            f"data.path={data}"]

    def run(model_path, out):
        args = [x for s in [*sets, f"model.path={model_path}"] for x in ("--set", s)]
        return subprocess.run([sys.executable, "-m", "portarl", "train", "--output-dir", str(tmp_path / out), *args],
                              capture_output=True, text=True, env=env, timeout=600)

    ok = run(tmp_path / "tiny.gguf", "run")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert (tmp_path / "run" / "metrics.jsonl").is_file()
    missing = run(tmp_path / "missing.gguf", "run2")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr, missing.stderr[-2000:]
    assert "missing.gguf" in missing.stderr and "does not exist" in missing.stderr
    (tmp_path / "cut.gguf").write_bytes((tmp_path / "tiny.gguf").read_bytes()[:5000])
    cut = run(tmp_path / "cut.gguf", "run3")
    lines = [line for line in cut.stderr.splitlines() if line.strip()]
    assert cut.returncode == 2 and len(lines) == 1 and "cut.gguf" in lines[0], cut.stderr[-2000:]


@pytest.mark.parametrize("keep", ["header", "half", "all-but-10-bytes"])
def test_a_truncated_gguf_file_is_one_error_naming_it(tmp_path, keep):
    """An interrupted download: refused with the file's name, not a ``struct.error`` or a
    reshape error from inside the reader."""
    write_tiny_gguf(tmp_path / "full.gguf")
    data = (tmp_path / "full.gguf").read_bytes()
    size = {"header": 1000, "half": len(data) // 2, "all-but-10-bytes": len(data) - 10}[keep]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:size])
    with pytest.raises(ValueError, match=r"cut\.gguf.*(truncated|damaged)"):
        load_local(cut)
