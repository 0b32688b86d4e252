"""One torchrun rank of ``portarl train`` (the CLI's own ``main``) with a probe: what this
rank's vllm engine was asked to generate and on which weights version, what a
tensor-parallel engine generated for the whole group (requests and outputs, before this
rank kept its rows), the rank's multi-turn episodes, the rank's own
mismatch metrics (before the mean over ranks), how its engine was launched, and every
weights file the process wrote. Written to ``<probe_dir>/rank<r>.json`` after each event
(the CLI leaves a torchrun job through ``os._exit``).

Usage: torchrun --nproc-per-node 2 vllm_torchrun_worker.py <probe_dir> train --set ...
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import safetensors.torch
import torch

PROBE = Path(sys.argv[1])
RANK = int(os.environ["RANK"])
RECORD = {"generate": [], "group": [], "episodes": [], "metrics": [], "engines": [], "weights_files": [],
          "pid": os.getpid()}


def _flush() -> None:
    tmp = PROBE / f"rank{RANK}.json.tmp"
    tmp.write_text(json.dumps(RECORD))
    os.replace(tmp, PROBE / f"rank{RANK}.json")


def _recording(fn, path_arg: int):
    def wrapper(*args, **kwargs):
        path = args[path_arg] if len(args) > path_arg else kwargs.get("filename", kwargs.get("f"))
        if isinstance(path, (str, os.PathLike)):  # not an in-memory buffer (torch.save into BytesIO)
            RECORD["weights_files"].append(str(path))
            _flush()
        return fn(*args, **kwargs)

    return wrapper


# Every way portarl writes tensors to a file, patched before portarl imports it.
safetensors.torch.save_file = _recording(safetensors.torch.save_file, 1)
safetensors.torch.save_model = _recording(safetensors.torch.save_model, 1)
torch.save = _recording(torch.save, 1)

from portarl.runtime import distributed as pdist  # noqa: E402
from portarl.rollout import vllm_tp  # noqa: E402
from portarl.rollout.vllm import VLLMRollout  # noqa: E402
from portarl.trainer.phases import rollout as rollout_phase  # noqa: E402

_generate, _init, _mean = VLLMRollout.generate, VLLMRollout.__init__, pdist.mean_metrics
_group_requests, _own_share, _play = vllm_tp.group_requests, vllm_tp.own_share, rollout_phase.play


def group_requests(prompts, seeds, group=None):
    everyone, group_seeds, rows = _group_requests(prompts, seeds, group)
    RECORD["group"].append({"seeds": group_seeds, "rows": [rows.start, rows.stop]})
    return everyone, group_seeds, rows


def own_share(batch, rows):
    RECORD["group"][-1].update(prompts=batch.prompt_ids, completions=batch.completion_ids, logprobs=batch.logprobs)
    _flush()
    return _own_share(batch, rows)


def play(agent, engine, sampling, examples, prompts, seeds, group_size, dist=None):
    rollout, texts, metrics, events = _play(agent, engine, sampling, examples, prompts, seeds, group_size, dist)
    RECORD["episodes"].append([{"turns": e["turns"], "finish": e["finish"], "messages": e["messages"],
                                "prompt_len": len(p), "tokens": list(p) + list(c)}
                               for e, p, c in zip(rollout.episodes, rollout.prompt_ids, rollout.completion_ids)])
    _flush()
    return rollout, texts, metrics, events


def generate(self, prompts, seeds, params):
    batch = _generate(self, prompts, seeds, params)
    RECORD["generate"].append({"version": self.weights_version, "prompts": [list(map(int, p)) for p in prompts],
                               "seeds": [int(s) for s in seeds]})
    _flush()
    return batch


def init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    parallel = self.llm.llm_engine.vllm_config.parallel_config
    RECORD["engines"].append({"backend": parallel.distributed_executor_backend,
                              "tensor_parallel_size": parallel.tensor_parallel_size})
    _flush()


def mean_metrics(ctx, metrics):
    RECORD["metrics"].append({k: float(v) for k, v in metrics.items() if k.startswith("mismatch/")})
    _flush()
    return _mean(ctx, metrics)


VLLMRollout.generate, VLLMRollout.__init__, pdist.mean_metrics = generate, init, mean_metrics
vllm_tp.group_requests, vllm_tp.own_share, rollout_phase.play = group_requests, own_share, play

if __name__ == "__main__":
    from portarl.cli import main

    sys.exit(main(sys.argv[2:]))
