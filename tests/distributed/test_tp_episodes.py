"""Multi-turn episodes on an engine that the ranks of a tensor-parallel group share
(``rollout.tensor_parallel_size`` > 1 with tools or an environment), without vLLM: 2 Gloo
processes play their own episodes through the trainer's ``play`` (with its lock step)
against an engine that does what the vllm engine does for a TP group
(:func:`portarl.rollout.vllm_tp.group_requests`, one generate over the group's requests,
:func:`~portarl.rollout.vllm_tp.own_share`), and an environment whose answers differ by
rank on purpose (``agent_tools.RankEnv``: rank 0's episodes end after one turn, rank 1's
after three, each answer naming the rank and its pid). And a stop signal that ends an
environment call on one rank only stops both ranks together, at the same call.

The real engine is in tests/vllm_engine/test_vllm_torchrun_agent.py (``make test-vllm``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

HERE = Path(__file__).parent
TRAINER_TESTS = Path(__file__).parents[1] / "trainer"
TURNS, G = 3, 2


class _Group:
    """What group_requests reads of vLLM's TP group coordinator."""

    def __init__(self, rank: int, world: int):
        self.cpu_group, self.rank_in_group, self.world_size = dist.group.WORLD, rank, world


def _interrupt_turn_2(executor) -> None:
    """The executor's first ``env_step`` of turn 2 (the ``G + 1``-th) ends as a stop signal
    arriving during the call would end it (``UserCodeGuard``: ``UserCodeError`` of kind
    ``interrupted``)."""
    from portarl.runtime.user_code import UserCodeError

    run, steps = executor.run, []

    def interrupted(op, *args):
        steps.append(op == "env_step")
        if op == "env_step" and sum(steps) == G + 1:
            raise UserCodeError("RankEnv.step", None, "was interrupted by SIGTERM", kind="interrupted")
        return run(op, *args)

    executor.run = interrupted


def _rank(rank: int, store: str, out: str, interrupt: bool) -> None:
    import sys

    sys.path.insert(0, str(TRAINER_TESTS))
    os.environ["RANK"] = str(rank)  # what RankEnv reads, as under torchrun
    from agent_tiny import ScriptedRollout, agent_tokenizer, tiny_model
    from portarl.runtime import distributed as pdist
    from portarl.assets.data import Example
    from portarl.multiturn.agent import make_agent
    from portarl.rollout import vllm_tp
    from portarl.rollout.base import SamplingParams
    from portarl.assets.tokenizer import TextCodec
    from portarl.trainer import TrainConfig
    from portarl.trainer.phases.episodes import play
    from portarl.runtime.user_code import UserCodeError

    class GroupEngine(ScriptedRollout):
        """One engine for the group: every rank's requests gathered, all generated, this rank's rows kept."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.group_calls = []

        def generate(self, prompts, seeds, params):
            everyone, group_seeds, rows = vllm_tp.group_requests(prompts, seeds, _Group(rank, 2))
            self.group_calls.append({"prompts": everyone, "seeds": group_seeds, "rows": [rows.start, rows.stop]})
            return vllm_tp.own_share(super().generate(everyone, group_seeds, params), rows)

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=300))  # bounds a hang only
    try:
        tok = agent_tokenizer()
        model = tiny_model(len(tok))
        cfg = TrainConfig.load(None, ["environment=agent_tools:RankEnv", f"rollout.max_turns={TURNS}"])
        codec = TextCodec(tok)
        agent = make_agent(cfg, codec)
        engine = GroupEngine(model, tok, ["one", "two", "three"])
        examples = [Example([{"role": "user", "content": f"Count {rank}"}], None, {}, f"row {rank}")]
        prompts = [codec.encode_prompt(ex.prompt) for ex in examples for _ in range(G)]
        if interrupt and rank == 1:
            _interrupt_turn_2(agent.executor)
        try:
            rollout, _, metrics, _ = play(agent, engine, SamplingParams(max_new_tokens=12), examples, prompts,
                                          [10 * rank + i for i in range(G)], G, pdist.DistContext(rank, 2, 0, "gloo"))
        except UserCodeError as err:  # what the trainer's loop stops on (portarl.trainer.loop.stop_on_user_code)
            result = {"raised": str(err), "calls": engine.group_calls}
        else:
            result = {"pid": os.getpid(), "calls": engine.group_calls, "episodes": rollout.episodes,
                      "tokens": [list(p) + list(c) for p, c in zip(rollout.prompt_ids, rollout.completion_ids)]}
        finally:
            agent.close()
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()  # neither rank closes its sockets while the other is still in a collective with it
    finally:
        dist.destroy_process_group()
    # Gloo's threads outlive the group: interpreter finalisation can race them and abort the
    # process ("terminate called without an active exception"; portarl/runtime/exit_path.py), as it
    # did here at random. A rank that got this far leaves as a portarl rank does.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(tmp: Path, interrupt: bool = False) -> list[dict]:
    """The 2 ranks, spawned from a process of their own: ``mp.spawn`` leaves a helper
    process of multiprocessing's (its resource tracker) running until the spawning process
    exits, and the other tests check that a run leaves no child of the test process behind."""
    cmd = [sys.executable, __file__, str(tmp), "interrupt" if interrupt else "whole"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return _spawn(tmp_path_factory.mktemp("tp-episodes"))


def test_the_ranks_of_a_group_send_the_engine_the_same_requests_at_every_turn(ranks):
    zero, one = (r["calls"] for r in ranks)
    assert len(zero) == len(one) == TURNS  # rank 0's episodes ended after one turn: it padded two more
    for k, (a, b) in enumerate(zip(zero, one)):
        assert a["prompts"] == b["prompts"] and a["seeds"] == b["seeds"], f"turn {k + 1}"
        assert a["rows"] == [0, G] and b["rows"] == [G, 2 * G]


def test_each_rank_keeps_its_own_episodes_with_its_own_environments_answers(ranks):
    for r, rank in enumerate(ranks):
        answers = [m["content"] for ep in rank["episodes"] for m in ep["messages"] if m["role"] != "assistant"]
        assert [ep["turns"] for ep in rank["episodes"]] == [1 + 2 * r] * G
        assert answers == [f"rank {r} pid {rank['pid']}"] * (2 * r * G)
    # Rank 1's third-turn contexts (its environment's answers in them) reached the engine as
    # rank 0 sent it its requests too: rank 1's rows of the group's last call, on rank 0.
    first_prompt = len(ranks[1]["calls"][0]["prompts"][G])
    third_turn = ranks[0]["calls"][-1]["prompts"][G:]
    for tokens in ranks[1]["tokens"]:
        assert any(len(p) > first_prompt and tokens[: len(p)] == p for p in third_turn)


def test_a_stop_signal_in_one_ranks_environment_call_stops_both_ranks_at_the_same_call(tmp_path):
    """Rank 1's first environment step of turn 2 is interrupted: it does not leave the loop
    alone (rank 0 would wait for it at the group's next call), both ranks raise at the next
    agreement, rank 0 with rank 1's message, after the same engine calls."""
    zero, one = _spawn(tmp_path, interrupt=True)
    assert one["raised"] == "RankEnv.step was interrupted by SIGTERM"
    assert zero["raised"] == "RankEnv.step was interrupted by SIGTERM (on rank 1)"
    assert len(zero["calls"]) == len(one["calls"]) == 2  # turns 1 and 2; none after the interrupted step
    assert [(c["prompts"], c["seeds"]) for c in zero["calls"]] == [(c["prompts"], c["seeds"]) for c in one["calls"]]


if __name__ == "__main__":  # _spawn's process: OUT_DIR whole|interrupt
    mp.spawn(_rank, args=(str(Path(sys.argv[1]) / "store"), sys.argv[1], sys.argv[2] == "interrupt"), nprocs=2,
             join=True)
