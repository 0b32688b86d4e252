"""Rollout pinning: record one run's rollouts and replay them to other runs.

Comparing two trainer settings on their own rollouts mixes sampling noise (different
numerics sample different tokens from the first step on) with numerical divergence.
Feeding every run the *same* rollouts, recorded from the first, leaves only the trainers'
numerics to differ: the method used in practice to align GPU and NPU runs.

The recording travels between machines (record on a GPU host, replay on an Ascend host),
so it is a safetensors file (ragged rows stored flat with their lengths, metadata as JSON
in the header): loading it parses data and never unpickles, so a file from elsewhere
cannot run code. ``torch.save`` / pickle files are refused by name.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from portarl.rollout.base import RolloutBatch, RolloutEngine, SamplingParams

FORMAT = "portarl-rollouts/1"
_PICKLE_MAGIC = (b"PK\x03\x04", b"\x80")  # torch.save zip archive; raw pickle protocol 2+


class RolloutFileError(ValueError):
    """A recorded-rollout file that is not portarl's safe format (or is damaged)."""


def _flat(rows, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    values = [v for r in rows for v in r]
    return torch.tensor(values, dtype=dtype), lengths


def _split(values: torch.Tensor, lengths: torch.Tensor) -> list[list]:
    if int(lengths.sum()) != values.numel():
        raise RolloutFileError("recorded rollouts are damaged: row lengths do not add up to the stored values")
    return [chunk.tolist() for chunk in torch.split(values, lengths.tolist())]


def save_rollouts(batches: list[RolloutBatch], path: str | Path, metadata: dict | None = None) -> str:
    """Write ``batches`` to ``path`` (safetensors); returns the file's sha256."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for i, b in enumerate(batches):
        tensors[f"{i}.prompt_ids"], tensors[f"{i}.prompt_lens"] = _flat(b.prompt_ids, torch.int64)
        tensors[f"{i}.completion_ids"], tensors[f"{i}.completion_lens"] = _flat(b.completion_ids, torch.int64)
        # float64: the engine's log-probs are Python floats; float64 round-trips them exactly.
        tensors[f"{i}.logprobs"], tensors[f"{i}.logprob_lens"] = _flat(b.logprobs, torch.float64)
        tensors[f"{i}.finished"] = torch.tensor([bool(f) for f in b.finished], dtype=torch.bool)
        if b.routed_experts is not None:  # MoE routing replay: [layers, tokens, k] per sample, along the tokens
            tensors[f"{i}.routed_experts"] = torch.cat([r.to(torch.int16) for r in b.routed_experts], dim=1)
            tensors[f"{i}.routed_lens"] = torch.tensor([r.shape[1] for r in b.routed_experts], dtype=torch.int64)
    meta = {"format": FORMAT, "batches": str(len(batches)), "metadata": json.dumps(metadata or {})}
    save_file(tensors, str(path), metadata=meta)
    return file_sha256(path)


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load_rollouts(path: str | Path) -> tuple[list[RolloutBatch], dict]:
    """``(batches, metadata)`` from a file written by :func:`save_rollouts`.

    Refuses pickles (``torch.save`` output included) before anything parses them."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    head = path.read_bytes()[:8] if path.exists() else None
    if head is None:
        raise RolloutFileError(f"recorded rollouts {path} do not exist")
    if head.startswith(_PICKLE_MAGIC):
        raise RolloutFileError(
            f"{path} is a pickle / torch.save file: portarl never unpickles recorded rollouts (unpickling runs "
            "code from the file); re-record them with this version (safetensors)"
        )
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise RolloutFileError(f"{path} is not a portarl rollout recording (safetensors): {err}") from None
    if meta.get("format") != FORMAT:
        raise RolloutFileError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    batches = []
    try:
        for i in range(int(meta["batches"])):
            batches.append(RolloutBatch(
                prompt_ids=_split(tensors[f"{i}.prompt_ids"], tensors[f"{i}.prompt_lens"]),
                completion_ids=_split(tensors[f"{i}.completion_ids"], tensors[f"{i}.completion_lens"]),
                logprobs=_split(tensors[f"{i}.logprobs"], tensors[f"{i}.logprob_lens"]),
                finished=tensors[f"{i}.finished"].tolist(),
            ))
            if f"{i}.routed_experts" in tensors:
                batches[-1].routed_experts = list(tensors[f"{i}.routed_experts"].split(
                    tensors[f"{i}.routed_lens"].tolist(), dim=1))
    except KeyError as err:
        raise RolloutFileError(f"{path} is damaged: missing tensor {err}") from None
    return batches, json.loads(meta.get("metadata", "{}"))


class RecordingRollout(RolloutEngine):
    """Wraps an engine and keeps every batch it returns, in call order."""

    name = "recording"

    def __init__(self, inner: RolloutEngine):
        self.inner = inner
        self.batches: list[RolloutBatch] = []
        #: Per batch, the vision inputs it was generated with (a vision-language model), else None.
        self.media: list = []

    def generate(self, prompts, seeds, params: SamplingParams, media=None) -> RolloutBatch:
        batch = self.inner.generate(prompts, seeds, params, **({} if media is None else {"media": media}))
        self.batches.append(batch)
        self.media.append(media)
        return batch

    def sync_weights(self, model) -> None:
        self.inner.sync_weights(model)

    def mark_trainer_updated(self) -> None:
        self.inner.mark_trainer_updated()

    def samples_policy_of(self, model) -> bool:
        return self.inner.samples_policy_of(model)

    def sleep(self) -> None:
        self.inner.sleep()

    def close(self) -> None:
        self.inner.close()

    def save(self, path: str | Path, metadata: dict | None = None) -> str:
        """Write the recording (safetensors, no pickle); returns its sha256."""
        return save_rollouts(self.batches, path, metadata)


class ReplayRollout(RolloutEngine):
    """Returns recorded batches in order; refuses prompts that differ from the recording."""

    name = "replay"

    def __init__(self, batches: list[RolloutBatch]):
        self.batches = list(batches)
        self.position = 0

    @classmethod
    def load(cls, path: str | Path) -> "ReplayRollout":
        return cls(load_rollouts(path)[0])

    def generate(self, prompts, seeds, params: SamplingParams, media=None) -> RolloutBatch:
        """``media`` (a vision-language model's pixels) is not needed: the tokens are the recording's."""
        if self.position >= len(self.batches):
            raise RuntimeError(f"replay exhausted after {len(self.batches)} recorded rollouts; record a longer run")
        batch = self.batches[self.position]
        if [list(p) for p in prompts] != batch.prompt_ids:
            raise RuntimeError(
                f"replayed rollout {self.position + 1} was recorded for different prompts: the data order "
                "differs from the recording (runs must share data, train.seed and train.prompts_per_step)"
            )
        self.position += 1
        return batch
