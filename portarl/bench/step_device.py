"""``portarl bench step --device cuda``: a whole GRPO step of a real-size model on a GPU,
portarl's against the same step written plainly, in one process.

Why: the kernels are timed alone by ``portarl bench kernels``; what a user pays is the step.
The plain step is what TRL's and verl's default paths compute for the loss: the model's
full logits (a [rows, T, V] tensor), ``log_softmax`` in fp32, ``gather`` of the sampled
tokens, the clipped token-mean GRPO loss, backward, AdamW, with fp32 weights and bf16
autocast (the Hugging Face Trainer's ``bf16=True``). portarl's step is ``GRPOTrainer``'s:
its rollout (the hf engine), rewards and advantages, and its update through the fused
linear log-probs (no logits tensor), bf16 compute with fp32 master weights.

Both sides train on the same batches: each step, portarl rolls out and scores, and the
plain side updates its own copy of the start model on that batch with those advantages.
So the rollout and scoring are timed once (the same engine and rewards on both sides),
and the sides differ in the update: a plain step is portarl's rollout + scoring + the
plain update. Reported per side: median step time, each phase, completion tokens per
second, and the peak device memory of the update (``torch.cuda.max_memory_allocated``,
reset before each; on the CPU, None).

Shapes (:data:`SHAPES`, shipped configs, random weights): ``qwen2.5-0.5b`` and
``qwen2.5-1.5b`` (their Hugging Face configs' sizes, vocabulary 151,936, tied embeddings),
and ``tiny`` for the CPU test. The tokenizer is the byte-level one of the built-in chat
model, its vocabulary padded with filler tokens to the model's (:func:`sized_tokenizer`),
so any sampled id decodes. A random model never ends a sample, so every completion is
``max_new_tokens`` long (512 by default on a GPU), and the reward (the share of digits in
the completion) differs between samples: every step has a gradient.
"""

from __future__ import annotations

import copy
import itertools
import statistics
import time

import torch

#: Qwen2ForCausalLM sizes (``transformers.Qwen2Config`` keywords) of each shipped shape.
SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151_936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151_936, tie_word_embeddings=True),
}
#: Defaults per device: (prompts, samples per prompt, new tokens, micro-batch rows, steps, warm-up steps).
DEFAULTS = {"cuda": dict(prompts=8, group=4, new_tokens=512, micro_batch=8, steps=3, warmup=1),
            "cpu": dict(prompts=2, group=2, new_tokens=8, micro_batch=4, steps=2, warmup=1)}
LR = 1e-5
CLIP = (0.2, 0.28)


def sized_tokenizer(vocab: int):
    """The built-in byte-level chat tokenizer with filler tokens up to ``vocab`` ids: text
    encodes to bytes as before; every id the model can sample decodes to some bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from portarl.assets.tokenizer import CHAT_TEMPLATE

    specials = ["<pad>", "<|im_start|>", "<|im_end|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    fillers = ("".join(p) for n in itertools.count(2) for p in itertools.product(alphabet, repeat=n))
    tokens = specials + alphabet + list(itertools.islice(fillers, max(0, vocab - len(specials) - len(alphabet))))
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"], model_max_length=1 << 20,
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build(shape: str, seed: int = 0):
    """``(model, tokenizer)``: the shape's Qwen2 with random weights (fp32, CPU) and its tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sizes = SHAPES[shape]
    config = Qwen2Config(**sizes, max_position_embeddings=4096, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval(), sized_tokenizer(sizes["vocab_size"])


def digit_share(prompt, completion, answer) -> float:
    """The share of digits in the completion: any model earns some, and samples differ."""
    return sum(c.isdigit() for c in completion) / max(1, len(completion))


class PlainUpdate:
    """The plain step's update on its own copy of the model: full logits, fp32 log_softmax,
    gather, the clipped token-mean loss over the batch, backward per micro-batch, AdamW."""

    def __init__(self, model, device: torch.device, micro_batch: int, checkpointing: bool):
        self.model = model.to(device=device, dtype=torch.float32).train()
        if checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.device, self.micro_batch = device, micro_batch
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, betas=(0.9, 0.99), weight_decay=0.0)

    def __call__(self, batch, advantages: torch.Tensor) -> None:
        tokens = batch.mask.sum()
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda")
        for r0 in range(0, batch.input_ids.shape[0], self.micro_batch):
            rows = slice(r0, r0 + self.micro_batch)
            width = batch.labels.shape[1]
            with autocast:
                logits = self.model(input_ids=batch.input_ids[rows], attention_mask=batch.attention_mask[rows],
                                    position_ids=batch.position_ids[rows]).logits
            logits = logits[:, -width - 1:-1].float()  # the positions that predict the completion tokens
            labels = batch.labels[rows]
            logp = torch.log_softmax(logits, dim=-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            ratio = torch.exp(logp - logp.detach())  # on-policy: 1, with the policy's gradient
            adv = advantages[rows].unsqueeze(-1)
            per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - CLIP[0], 1 + CLIP[1]) * adv)
            loss = (per_token * batch.mask[rows]).sum() / tokens
            loss.backward()
            del logits, logp, ratio, per_token, loss
        self.grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_reset(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_mib(device):
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def run_shape(shape: str, device: torch.device, *, prompts: int, group: int, new_tokens: int, micro_batch: int,
              steps: int, warmup: int, progress=lambda line: None) -> dict:
    """Both sides on one shape; per-step records and their medians."""
    from portarl.assets.data import Example, arithmetic_examples
    import portarl.trainer.phases.iteration as grpo_module
    from portarl.bench.step_side import timed
    from portarl.trainer import GRPOTrainer, TrainConfig

    model, tok = build(shape)
    plain = PlainUpdate(copy.deepcopy(model), device, micro_batch, checkpointing=shape != "tiny")
    sets = [f"device={device.type}", f"precision.dtype={'bf16' if device.type == 'cuda' else 'fp32'}",
            f"train.steps={steps}", f"train.prompts_per_step={prompts}", f"rollout.group_size={group}",
            f"rollout.max_new_tokens={new_tokens}", f"train.micro_batch_size={micro_batch}",
            "train.sft_warmup_steps=0", f"optim.lr={LR}", "loss.kl_coef=0.0", "data.chat_template=auto",
            f"train.gradient_checkpointing={str(shape != 'tiny').lower()}", "logging.progress=false",
            "logging.tensorboard=false", "logging.plot=false", "checkpoint.every=1000000"]
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig.load(None, [*sets, f"output_dir={tmp}"])
        data = [Example([{"role": "user", "content": ex.prompt}], ex.answer)
                for ex in arithmetic_examples(prompts * (steps + 1), seed=0)]
        trainer = GRPOTrainer(model, tok, [digit_share], data, cfg, device=str(device))
        phases, scored_box = {}, {}
        engine = trainer.rollout
        engine.generate = timed(phases, "rollout", engine.generate)
        real_score = grpo_module.score

        def score(*args, **kwargs):
            scored_box["scored"] = out = real_score(*args, **kwargs)
            return out

        grpo_module.score = timed(phases, "scoring", score)
        records = []
        try:
            for step in range(steps):
                phases.clear()
                _sync(device)
                _peak_reset(device)
                t0 = time.perf_counter()
                metrics = trainer.train_step()
                _sync(device)
                wall = time.perf_counter() - t0
                portarl_peak = _peak_mib(device)
                scored = scored_box["scored"]
                _peak_reset(device)
                t1 = time.perf_counter()
                plain(scored.batch, scored.advantages)
                _sync(device)
                plain_update = time.perf_counter() - t1
                rollout, scoring = phases["rollout"][0], phases.get("scoring", [0.0])[0]
                tokens = int(scored.batch.mask.sum())
                records.append({
                    "step": step + 1, "completion_tokens": tokens, "reward_mean": metrics["reward/mean"],
                    "grad_norm": metrics["grad_norm"], "plain_grad_norm": plain.grad_norm,
                    "rollout_s": rollout, "scoring_s": scoring,
                    "portarl": {"step_s": wall, "update_s": wall - rollout - scoring, "update_peak_mib": portarl_peak},
                    "plain": {"step_s": rollout + scoring + plain_update, "update_s": plain_update,
                              "update_peak_mib": _peak_mib(device)}})
                progress(f"{shape} step {step + 1}/{steps}: rollout {rollout:.2f} s, portarl update "
                         f"{wall - rollout - scoring:.2f} s, plain update {plain_update:.2f} s")
        finally:
            grpo_module.score = real_score
    timed_steps = records[warmup:] or records[-1:]

    def med(side, key):
        values = [r[side][key] for r in timed_steps if r[side][key] is not None]
        return statistics.median(values) if values else None

    summary = {}
    for side in ("portarl", "plain"):
        step_s = med(side, "step_s")
        summary[side] = {"step_s": step_s, "update_s": med(side, "update_s"), "update_peak_mib": med(side, "update_peak_mib"),
                         "tokens_per_s": statistics.median(r["completion_tokens"] for r in timed_steps) / step_s}
    summary["rollout_s"] = statistics.median(r["rollout_s"] for r in timed_steps)
    summary["scoring_s"] = statistics.median(r["scoring_s"] for r in timed_steps)
    summary["step_speedup"] = summary["plain"]["step_s"] / summary["portarl"]["step_s"]
    summary["update_speedup"] = summary["plain"]["update_s"] / summary["portarl"]["update_s"]
    return {"shape": shape, "sizes": SHAPES[shape], "steps": records, "summary": summary}


def run(device: str, shapes: list[str], progress=lambda line: None, **overrides) -> dict:
    dev = torch.device(device)
    if dev.type not in DEFAULTS:
        raise ValueError(f"--device {device}: the step benchmark runs on cuda or cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch sees no CUDA device")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise ValueError(f"--shapes {' '.join(unknown)}: unknown; choose from {', '.join(SHAPES)}")
    settings = {**DEFAULTS[dev.type], **{k: v for k, v in overrides.items() if v is not None}}
    if not 0 <= settings["warmup"] < settings["steps"]:
        raise ValueError(f"need 0 <= --warmup < --steps, got warmup {settings['warmup']}, steps {settings['steps']}")
    results = [run_shape(s, dev, progress=progress, **settings) for s in shapes]
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return {"device": name, "settings": settings, "shapes": results,
            "command": f"portarl bench step --device {device} --shapes {' '.join(shapes)}"}


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [f"# One GRPO step on {result['device']}: portarl against the plain step", "",
             f"Command: `{result['command']}`. {s['prompts']} prompts x {s['group']} samples, {s['new_tokens']} new "
             f"tokens, micro-batches of {s['micro_batch']} rows; medians of {s['steps'] - s['warmup']} step(s) after "
             f"{s['warmup']} warm-up. The plain step: full logits, fp32 log_softmax, gather (TRL's and verl's default "
             "loss path), fp32 weights under bf16 autocast; the same rollout and rewards (portarl's, timed once).", "",
             "| shape | rollout s | scoring s | portarl update s | plain update s | portarl step s | plain step s "
             "| step speed-up | portarl tokens/s | plain tokens/s | portarl update peak MiB | plain update peak MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(v, fmt=".2f"):
        return "-" if v is None else format(v, fmt)

    for r in result["shapes"]:
        m, p, q = r["summary"], r["summary"]["portarl"], r["summary"]["plain"]
        lines.append(f"| {r['shape']} | {f(m['rollout_s'])} | {f(m['scoring_s'])} | {f(p['update_s'])} | "
                     f"{f(q['update_s'])} | {f(p['step_s'])} | {f(q['step_s'])} | {f(m['step_speedup'])}x | "
                     f"{f(p['tokens_per_s'], '.0f')} | {f(q['tokens_per_s'], '.0f')} | {f(p['update_peak_mib'], '.0f')} | "
                     f"{f(q['update_peak_mib'], '.0f')} |")
    return "\n".join(lines) + "\n"
