"""Issue 62: a default 2-rank torchrun run's console holds nothing a user cannot act on.

It printed torch's FSDP2 warning "FSDP2-wrapped module (FSDPQwen2ForCausalLM) returned a view
tensor ... will silently drop the pre-backward hook and skip the all-gather" once per rank:
the trainer's head passthrough (portarl.trainer.phases.sequences._HeadPassthrough) returned the
hidden states transformers had sliced before its head, a view of the decoder's output, as the
root module's output. It now returns a copy (the same bits); the first test below holds that
no view leaves the passthrough, so no in-place op can reach one. It also printed the
"model on cpu" line and rank 1's INFO lines (the decode path, the warm-up's loss) once per
rank; ranks other than 0 now log warnings and errors only (portarl/cli/train.py).
"""

from __future__ import annotations

import re
import subprocess
from collections import Counter

import pytest
import torch

pytest.importorskip("transformers")

from portarl.runtime.distributed import local_launcher  # noqa: E402
from test_fsdp_gloo import _env  # noqa: E402

#: The run's own lines carry a timestamp and a level (logging) or start with "portarl train:".
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (\w+) (.*)$")


def test_the_head_passthrough_returns_a_tensor_of_its_own_with_the_same_bits():
    from portarl.assets.models import build_tiny
    from portarl.trainer.phases.sequences import _HeadPassthrough

    model, _ = build_tiny(hidden_size=32, intermediate_size=64)
    ids = torch.randint(3, 60, (2, 9))
    hidden = model.get_decoder()(input_ids=ids).last_hidden_state
    for keep in (0, 4):
        with _HeadPassthrough(model) as head:
            out = model(input_ids=ids, logits_to_keep=keep).logits
        assert out._base is None, "a view of the decoder's output: FSDP2 warns, and an in-place op would drop its hook"
        assert torch.equal(out, hidden[:, -keep:] if keep else hidden)
        assert head.weight is model.get_output_embeddings().weight
        out.mul_(2.0).sum().backward()  # an in-place op on the output: allowed, gradients still flow to the model
        assert model.get_decoder().layers[0].mlp.down_proj.weight.grad is not None
        model.zero_grad()


def test_a_two_rank_run_prints_each_line_once_and_no_warning(tmp_path):
    """The default run (progress bars, TensorBoard, the plot, a warm-up), 2 ranks on Gloo."""
    cmd = [*local_launcher(2), "-m", "portarl", "train", "--device", "cpu", "--output-dir", str(tmp_path / "run"),
           "--steps", "3", "--set", "train.sft_warmup_steps=3"]
    proc = subprocess.run(cmd, env=_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    console = (proc.stdout + proc.stderr).replace("\r", "\n")
    assert "returned a view tensor" not in console
    assert not re.search(r"\w+Warning\b", console), [line for line in console.splitlines() if "Warning" in line]
    lines = [line.strip() for line in console.splitlines() if line.strip() and "%|" not in line]  # not a bar's frame
    levels = [m.group(1) for line in lines if (m := LOG_LINE.match(line))]
    assert levels and set(levels) == {"INFO"}, [line for line in lines if " INFO " not in line]
    texts = Counter(m.group(2) if (m := LOG_LINE.match(line)) else line for line in lines)
    assert not [t for t, n in texts.items() if n > 1], f"printed more than once: {[t for t, n in texts.items() if n > 1]}"
    assert sum("portarl train: tiny model on cpu" in t for t in texts) == 1
