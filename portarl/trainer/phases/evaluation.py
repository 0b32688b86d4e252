"""Evaluation on held-out prompts: during training (``eval.data`` every ``eval.every``
iterations) and outside it (``portarl eval --checkpoint C --data F``).

Each prompt gets ``eval.n`` completions, greedy (``eval.greedy``, n = 1) or sampled at the
rollout's temperature / top-p / top-k with seeds fixed per (prompt, sample), the same at
every evaluation, so two evaluations differ only by the weights. They are scored with the
training rewards (the ``rewards`` section, weights included; no length shaping and no KL
term: the task reward only). Metrics (``eval/*``): ``eval/reward/mean`` (weighted total),
``eval/reward/<function>`` (each function's mean), ``eval/reward/best_of_n`` (mean over
prompts of the best sample; n > 1), ``eval/completion/len_mean``,
``eval/completion/finished_frac``, ``eval/prompts``. With tools or an environment each
completion is a multi-turn episode, as in training, and ``eval/agent/*`` are its metrics
(:mod:`portarl.multiturn.report`).

During training the metrics join the step's row (metrics.jsonl, TensorBoard, the summary,
curves.png), and the checkpoint with the best ``eval.best_metric`` (higher is better) is
kept under ``<output_dir>/best/checkpoints/`` with ``best/best.json`` naming its step and
value (read back on ``--resume``, so a resumed run only replaces a better best).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from portarl.assets.data import encode_examples, load_examples_for
from portarl.rollout import SamplingParams
from portarl.rollout.base import seed_of

log = logging.getLogger("portarl.train")

#: Prompts per generate call (bounds the KV cache of a large eval set).
EVAL_CHUNK = 256


def eval_seeds(run_seed: int, num_prompts: int, n: int) -> list[int]:
    """One seed per (prompt, sample), the same at every evaluation of a run."""
    return [seed_of(f"{run_seed}/eval/{p}/{s}") for p in range(num_prompts) for s in range(n)]


def load_eval_set(config, codec, context_length: int | None, path: str | None = None):
    """``(examples, prompt_ids)`` of ``path`` (default ``eval.data``), at most
    ``eval.max_prompts`` (0: all), encoded and checked now (errors name file:line)."""
    path = path or config.eval.data
    if not Path(path).exists():
        raise FileNotFoundError(f"eval.data: {path} does not exist; point eval.data (or --data) at a JSONL / Parquet "
                                "file of prompts and answers")
    examples = load_examples_for(config.data, path)
    if config.eval.max_prompts:
        examples = examples[: config.eval.max_prompts]
    if not examples:
        raise ValueError(f"eval.data: {path} holds no examples")
    if isinstance(config.environment, dict):  # each row names its environment: checked now, not mid-evaluation
        from portarl.multiturn.environment import check_rows

        check_rows(examples, list(config.environment), "eval.data")
    ids = encode_examples(examples, codec, context_length=context_length, max_new_tokens=config.rollout.max_new_tokens)
    return examples, ids


def evaluate(engine, model, codec, rewards, examples, prompt_ids, config, agent=None) -> dict[str, float]:
    """Generate ``eval.n`` completions per prompt with ``engine`` (synced to ``model``),
    score them with ``rewards`` (a :class:`~portarl.assets.reward_runner.RewardRunner`), return
    the ``eval/*`` metrics (see the module docstring). ``agent`` (tools / environment):
    each completion is a multi-turn episode, scored on its final turn and conversation as
    in training, with its ``eval/agent/*`` metrics."""
    e, r = config.eval, config.rollout
    n = e.n
    params = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                            greedy=e.greedy)
    prompts = [ids for ids in prompt_ids for _ in range(n)]
    seeds = eval_seeds(config.train.seed, len(prompt_ids), n)
    engine.sync_weights(model)
    completions, finished, texts, rows, agent_metrics = [], [], [], [], []
    step = EVAL_CHUNK * n
    for start in range(0, len(prompts), step):
        if agent is None:
            batch_vision = getattr(codec, "batch_vision", None)  # a vision-language model: pixels and positions
            media = {} if batch_vision is None else {"media": batch_vision(examples[start // n : (start + step) // n], n)}
            batch = engine.generate(prompts[start : start + step], seeds[start : start + step], params, **media)
            texts += [codec.decode(c) for c in batch.completion_ids]
        else:
            from portarl.trainer.phases.episodes import play, reward_examples

            chunk = examples[start // n : (start + step) // n]
            batch, chunk_texts, chunk_metrics, _ = play(agent, engine, params, chunk, prompts[start : start + step],
                                                        seeds[start : start + step], n, training=False)
            texts += chunk_texts
            rows += reward_examples(chunk, n, batch, bool(agent.factories))
            agent_metrics.append((len(chunk_texts), chunk_metrics))
        completions += batch.completion_ids
        finished += batch.finished
    engine.sleep()
    scores = rewards.score(rows or [examples[i // n] for i in range(len(texts))], texts)
    total = scores.total.double()
    metrics = {f"eval/{k}": float(v) for k, v in scores.metrics.items()}
    for key in agent_metrics[0][1] if agent_metrics else ():  # episode-weighted over chunks
        metrics[f"eval/{key}"] = sum(k * m[key] for k, m in agent_metrics) / len(texts)
    metrics["eval/reward/mean"] = float(total.mean())
    if n > 1:
        metrics["eval/reward/best_of_n"] = float(total.view(-1, n).max(dim=1).values.mean())
    metrics["eval/completion/len_mean"] = sum(map(len, completions)) / len(completions)
    metrics["eval/completion/finished_frac"] = sum(finished) / len(finished)
    metrics["eval/prompts"] = float(len(prompt_ids))
    return metrics


class Evaluator:
    """Evaluation during training for a :class:`~portarl.trainer.GRPOTrainer`: the eval set
    loaded (and checked) when the trainer is built, the cadence, and the best checkpoint."""

    def __init__(self, trainer):
        self.config = trainer.config
        ctx = getattr(getattr(trainer.model, "config", None), "max_position_embeddings", None)
        self.examples, self.prompt_ids = load_eval_set(self.config, trainer.codec, ctx)
        self.best_dir = Path(self.config.output_dir) / "best"
        self.best: dict | None = None
        self._best_read = False  # read at the first evaluation: after --overwrite has cleared the run


    def _read_best(self) -> dict | None:
        path = self.best_dir / "best.json"
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            log.warning("%s is not readable JSON: the best checkpoint will be chosen afresh", path)
            return None

    def due(self, step: int) -> bool:
        return step % self.config.eval.every == 0 or step == self.config.train.steps

    def run(self, trainer) -> dict[str, float]:
        return evaluate(trainer.rollout, trainer.model, trainer.codec, trainer.rewards, self.examples,
                        self.prompt_ids, self.config, trainer.agent)

    def keep_best(self, trainer, metrics: dict) -> str | None:
        """Save the checkpoint of this step under ``best/`` when ``eval.best_metric``
        improved; returns the event message, or None."""
        from portarl.trainer.run import persistence
        from portarl.trainer.checkpoint import CheckpointManager
        from portarl.trainer.guards.step_guard import checkpoint_refusal

        key = self.config.eval.best_metric
        if key is None or key not in metrics:
            return None
        if not self._best_read:
            self.best, self._best_read = self._read_best(), True
        value = float(metrics[key])
        if self.best is not None and not value > self.best["value"]:
            return None
        if checkpoint_refusal(trainer) is not None:
            return None
        path = CheckpointManager(self.best_dir, keep_last=1).save(trainer.step, trainer.model, trainer.tokenizer,
                                                                  persistence.trainer_state(trainer))
        self.best = {"metric": key, "value": value, "step": trainer.step, "checkpoint": str(path)}
        (self.best_dir / "best.json").write_text(json.dumps(self.best) + "\n")
        return f"best {key} so far: {value:.4g} at step {trainer.step}; checkpoint {path}"


def eval_checkpoint(checkpoint, data: str, *, n: int | None = None, greedy: bool | None = None,
                    max_prompts: int | None = None, device: str = "auto") -> dict[str, float]:
    """``portarl eval``: the checkpoint's model and run config (rewards, sampling), on ``data``.
    ``n`` > 1 without ``greedy`` samples; ``greedy=True`` with ``n`` > 1 is refused."""
    import dataclasses

    from portarl.backends.device import resolve_device
    from portarl.trainer.checkpoint.export import load_checkpoint_model
    from portarl.assets.reward_runner import RewardRunner
    from portarl.rollout.hf import HFRollout
    from portarl.assets.tokenizer import chat_template_option
    from portarl.vision.codec import codec_for

    _, config, model, tokenizer = load_checkpoint_model(checkpoint)
    e = config.eval
    if greedy and n is not None and n > 1:
        raise ValueError(f"--n {n} needs --greedy false (greedy completions of a prompt are all the same)")
    if greedy is None:  # --n > 1 alone means sampling
        greedy = e.greedy if n is None else n == 1 and e.greedy
    n = (1 if greedy else e.n) if n is None else n
    config.eval = dataclasses.replace(e, data=data, n=n, greedy=greedy,
                                      max_prompts=e.max_prompts if max_prompts is None else max_prompts)
    config.eval.validate()
    device = resolve_device(device)
    model.to(device)
    codec = codec_for(tokenizer, model, chat_template=chat_template_option(config.data.chat_template),
                     system_prompt=config.data.system_prompt)
    from portarl.multiturn.agent import make_agent

    agent = make_agent(config, codec, config.code_search_dirs())  # tools / environment: episodes, as in training
    ctx = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    examples, ids = load_eval_set(config, codec, ctx, data)
    engine = HFRollout(model, codec.eos_token_id, codec.pad_token_id, stop_token_ids=codec.stop_token_ids,
                       lean_decode=config.rollout.lean_decode)
    rewards = RewardRunner(config.rewards, search_dirs=config.code_search_dirs(), timeout_s=config.train.reward_timeout_s,
                           device=device, precision_dtype=config.precision.dtype)
    try:
        with rewards, torch.no_grad():  # the reward watchdog's thread is joined on the way out
            return evaluate(engine, model, codec, rewards, examples, ids, config, agent)
    finally:
        if agent is not None:  # tool_isolation=process: its tool process
            agent.close()
