"""The TRL side of ``portarl bench step --vs trl``: TRL's GRPOTrainer on the same work.

The only module of portarl that imports ``trl`` (``pip install 'portarl[bench]'``). The
settings mirror :func:`portarl.bench.step.run_portarl` (see that module's docstring);
``gradient_checkpointing`` is the work's (portarl checkpoints each decoder layer too), the
micro-batching :meth:`portarl.bench.step_work.Work.trl_batching`. The reference model (beta
> 0): TRL loads its own from the policy's path; a GGUF file or the tiny model built from a
config has no path TRL can load, so TRL's loader is replaced by a fresh
:func:`portarl.bench.step_work.load` of the same work: the same weights, loaded again, as TRL
would. Steps are timed
from ``on_step_begin`` (after the driver's go when the sides step in turn) to ``on_step_end`` (generation, scoring, loss, backward, optimizer;
not TRL's logging); phases by wrapping ``_generate`` and ``_generate_and_score_completions``.
"""

from __future__ import annotations

import tempfile
import time

from portarl.bench import step_work
from portarl.bench.step_side import finish, gate, set_threads, step_record, timed
from portarl.bench.step_work import Work


def run_trl(steps: int, threads: int, work: Work) -> dict:
    started = time.perf_counter()
    set_threads(threads)
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer import grpo_trainer

    fn = step_work.reward_fn(work)
    rewards: list[float] = []  # this step's, for its reward per sample

    def reward(prompts, completions, answer, **kwargs):  # TRL passes the dataset's columns by name
        values = [fn(p, step_work.completion_text(c), a) for p, c, a in zip(prompts, completions, answer)]
        rewards.extend(values)
        return values

    def reference(model_id, **kwargs):  # TRL's own: create_model_from_path(the policy's path)
        return step_work.load(work)[0]

    grpo_trainer.create_model_from_path = reference
    policy, tok = step_work.load(work)
    baseline = step_work.rss_mib()

    phases: dict = {}
    records: list[dict] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            gate()  # stepping in turn with the portarl worker: wait for this step's go
            phases.clear()
            rewards.clear()
            self.t0, self.w0, self.c0 = time.time(), time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            wall, cpu = time.perf_counter() - self.w0, time.process_time() - self.c0
            both, rollout = phases.get("generate_and_score"), phases.get("rollout")
            split = {"rollout": rollout} if rollout else {}
            if both and rollout:
                split["scoring"] = [both[0] - rollout[0], both[1] - rollout[1]]
            records.append({**step_record(wall, cpu, split, self.t0),
                            "reward_mean": sum(rewards) / len(rewards) if rewards else None})

    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(
            output_dir=tmp, **work.trl_batching(), max_completion_length=work.max_new_tokens, max_steps=steps,
            learning_rate=work.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
            adam_beta2=0.99, max_grad_norm=1.0, beta=work.beta, epsilon=0.2, epsilon_high=0.28, loss_type="dapo",
            temperature=work.temperature, top_p=1.0, top_k=0, gradient_checkpointing=work.gradient_checkpointing, use_cpu=True, bf16=False, fp16=False, report_to="none",
            logging_steps=1, save_strategy="no", dataloader_num_workers=0, seed=0, log_completions=False,
            disable_tqdm=True,
        )
        pairs = step_work.prompts(work, work.prompts_per_step * (steps + 2))
        data = Dataset.from_list([{"prompt": list(p) if isinstance(p, tuple) else p, "answer": a} for p, a in pairs])
        trl_trainer = GRPOTrainer(model=policy, reward_funcs=[reward], args=config, train_dataset=data,
                                  processing_class=tok, callbacks=[StepTimer()])
        del policy
        trl_trainer._generate = timed(phases, "rollout", trl_trainer._generate)
        trl_trainer._generate_and_score_completions = timed(phases, "generate_and_score",  # TRL's own methods
                                                            trl_trainer._generate_and_score_completions)
        trl_trainer.train()
        return finish(records, threads, started, baseline, trl_trainer.model)
