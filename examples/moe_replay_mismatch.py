"""Measures what routing replay does to the train-inference mismatch of an MoE model
(docs/moe.md's table): the built-in tiny Qwen3-MoE and Qwen2-MoE, one GRPO step each,
with a rollout engine that routes otherwise than the trainer on near-ties (its top-k taken
from the router's probabilities plus uniform noise in [0, 0.2), its gate values the
router's: what an engine whose router kernel rounds differently does), replay on
(``rollout.routing_replay: rollout``) and the recorded experts ignored (the trainer routes
by itself, as with replay off).

    OMP_NUM_THREADS=1 python examples/moe_replay_mismatch.py
"""

import tempfile

import torch

from portarl.assets.data import arithmetic_examples
from portarl.moe import routing
from portarl.moe.models import BUILTIN_MOES, build_tiny_moe
from portarl.trainer import GRPOTrainer, TrainConfig


def reward(prompt, completion, answer):
    return float(sum(map(ord, completion)) % 5)


def step(name: str, replay: bool) -> dict:
    model, tokenizer = build_tiny_moe(name, seed=3)
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig.load(None, ["rollout.routing_replay=rollout", "train.steps=1", "train.prompts_per_step=8",
                                      "rollout.group_size=4", "rollout.max_new_tokens=8", "train.sft_warmup_steps=0",
                                      "logging.progress=false", "logging.tensorboard=false", "logging.plot=false",
                                      f"output_dir={out}"])
        trainer = GRPOTrainer(model, tokenizer, [reward], arithmetic_examples(32, seed=0), cfg, device="cpu")
        generate, original = trainer.rollout.generate, routing.choose
        gen = torch.Generator().manual_seed(0)

        def noisy(probs, k):
            return original(probs + torch.rand(probs.shape, generator=gen) * 0.2, k)

        def disagreeing(*args, **kwargs):
            routing.choose = noisy
            try:
                return generate(*args, **kwargs)
            finally:
                routing.choose = original

        trainer.rollout.generate = disagreeing
        keep = routing.set_replay
        if not replay:
            routing.set_replay = lambda *a, **k: None
        try:
            return trainer.train_step()
        finally:
            routing.set_replay = keep
            trainer.close()


def main() -> None:
    print("| model | replay | routing agreement | mismatch k3 | max abs d logp |")
    print("|---|---|---|---|---|")
    for name in BUILTIN_MOES:
        for replay in (False, True):
            m = step(name, replay)
            agreement = m.get("rollout/routing_agreement")
            print(f"| {name} | {'on' if replay else 'off'} | {'-' if agreement is None else f'{agreement:.3f}'} | "
                  f"{m['mismatch/kl_k3']:.2e} | {m['mismatch/abs_diff_max']:.2e} |")


if __name__ == "__main__":
    main()
