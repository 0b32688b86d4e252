"""Prompts with images on the vllm engine: vLLM's ``multi_modal_data`` requests, the image
placeholders never sampled, and log-probs of the full distribution.

**Images.** A row goes to vLLM as ``TokensPrompt(prompt_token_ids, multi_modal_data=
{"image": [PIL images]})``, the images opened from the row's sources
(:attr:`portarl.vision.inputs.VisionBatch.images`) exactly as the trainer's processor opens
them. vLLM (0.32, ``BaseMultiModalProcessor.apply``) always expands each image's
placeholder itself (one ``<|image_pad|>`` becomes the image's patch count, from its own run
of the model's processor); the trainer's prompt ids are the processor's output, already
expanded, so each image's run of placeholders is collapsed to one before the request
(:func:`collapse_placeholders`; sent expanded, every placeholder of the run would be
expanded again). vLLM's expanded prompt is then checked against the trainer's, token for
token (:func:`check_expansion`): the tokens the trainer scores are the tokens vLLM ran.

**Placeholders never sampled, log-probs of the full distribution.** A sampled
``<|image_pad|>`` would be taken by the training forward for an image's slot, so it must
never be drawn; but vLLM's processed log-probs are computed after its logits processors,
so a ban by ``bad_words`` / ``allowed_token_ids`` / a plain logits processor would return
log-probs renormalised over the allowed tokens: ``log p(t) - log(1 - P(placeholders))``,
not the trainer's. :func:`placeholder_ban` is a vLLM logits processor that bans them and
records, per request and completion position, that difference (``logsumexp`` of all the
tempered logits minus that of the allowed ones); :func:`full_logprobs` subtracts it, so
the engine returns the full distribution's log-probs, as the hf engine does. The record
is read in this process: the engine core must run in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which :func:`portarl.rollout.vllm_build.engine_from_config`
sets and :class:`~portarl.rollout.vllm.VLLMRollout` checks for a vision model).
"""

from __future__ import annotations

import functools
import itertools
import math
import os

import torch

#: ``SamplingParams.extra_args`` key naming a request's record (:data:`_RECORDS`).
BAN_KEY = "portarl_ban"
#: request key -> {"banned": tuple of token ids, "temperature": float, "shift": {position: float}}
_RECORDS: dict[str, dict] = {}
_ids = itertools.count()


def is_vision_dir(model_dir) -> bool:
    """Whether ``model_dir``'s ``config.json`` is a vision-language model's (a ``vision_config``)."""
    import json
    from pathlib import Path

    try:
        return "vision_config" in json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False


def extra_args(key) -> dict:
    """``SamplingParams`` keywords flagging a request for the placeholder ban (none for None)."""
    return {} if key is None else {"extra_args": {BAN_KEY: key}}


def requests(prompts, media, params) -> tuple[list, list]:
    """vLLM's requests for ``prompts`` with ``media`` (a VisionBatch), and per row the key of
    its ban record (None where nothing is banned)."""
    from vllm.inputs import TokensPrompt

    out = []
    for i, (prompt, images) in enumerate(zip(prompts, open_images(media.images or [()] * len(prompts)))):
        if images:
            ids = collapse_placeholders(list(prompt), media.image_token_id, len(images), i)
            out.append(TokensPrompt(prompt_token_ids=ids, multi_modal_data={"image": images}))
        else:
            out.append(TokensPrompt(prompt_token_ids=list(prompt)))
    temperature = 0.0 if params.greedy else params.temperature
    keys = [new_record(media.unsampleable, temperature) if media.unsampleable else None for _ in prompts]
    return out, keys


def reset_encoder_cache(llm) -> None:
    """Drop vLLM's cached image embeddings after a weight sync: they were computed by the old
    weights (the projector trains). vLLM's in-place reload clears the worker's cache but not
    the scheduler's record of it (vLLM 0.32, ``gpu_model_runner.reload_weights``), whose
    next request then fails "Encoder cache miss"; the engine's ``reset_encoder_cache``
    clears both."""
    reset = getattr(getattr(llm, "llm_engine", None), "reset_encoder_cache", None)
    if reset is None:
        raise RuntimeError("this vLLM has no LLMEngine.reset_encoder_cache: cached image embeddings would outlive a "
                           "weight sync; use a vLLM that has it (0.32 does) for rollout.engine=vllm with a vision-language model")
    reset()


def refuse_out_of_process() -> None:
    """The ban's record is read in this process: refuse an engine core in another one."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0":
        raise ValueError("the vllm engine with a vision-language model needs its engine core in this process (the "
                         "placeholder ban's log-prob correction is read here): set VLLM_ENABLE_V1_MULTIPROCESSING=0")


def collapse_placeholders(ids: list[int], image_token_id: int, images: int, row: int) -> list[int]:
    """``ids`` with each run of ``image_token_id`` cut to one token (what vLLM expands);
    ValueError when the runs are not one per image."""
    out, runs = [], 0
    for token in ids:
        if token == image_token_id:
            if out and out[-1] == image_token_id:
                continue
            runs += 1
        out.append(token)
    if runs != images:
        raise ValueError(f"row {row}: {runs} image placeholder runs in the prompt but {images} images")
    return out


def check_expansion(expanded: list[int], prompt: list[int], row: int) -> None:
    """vLLM's expanded prompt must be the trainer's, token for token."""
    if list(expanded) != list(prompt):
        raise ValueError(f"row {row}: vLLM expanded the images to {len(expanded)} prompt tokens, the trainer's "
                         f"processor to {len(prompt)}: the processor saved in the model directory resizes differently "
                         "(model.min_pixels / model.max_pixels are passed to vLLM as mm_processor_kwargs)")


def open_images(sources_per_row: list) -> list[list]:
    """Each row's PIL images, each distinct source tuple opened once (a group's G rows share one)."""
    from portarl.vision.images import open_image

    opened: dict[int, list] = {}
    out = []
    for sources in sources_per_row:
        key = id(sources)
        if key not in opened:
            opened[key] = [open_image(src) for src in sources]
        out.append(opened[key])
    return out


def new_record(banned: tuple, temperature: float) -> str:
    key = f"r{next(_ids)}"
    _RECORDS[key] = {"banned": tuple(int(t) for t in banned), "temperature": float(temperature), "shift": {}}
    return key


def full_logprobs(key: str, processed: list[float]) -> list[float]:
    """The full distribution's log-probs of a request's sampled tokens from vLLM's processed
    ones (renormalised without the banned tokens); the record is dropped."""
    record = _RECORDS.pop(key)
    shift = record["shift"]
    missing = [j for j in range(len(processed)) if j not in shift]
    if missing:
        raise RuntimeError(f"the placeholder ban saw no logits for completion position {missing[0]} (vLLM's engine "
                           "core outside this process, or a vLLM whose logits processors skip this request)")
    return [lp - shift[j] for j, lp in enumerate(processed)]


def drop_records(keys) -> None:
    for key in keys:
        if key is not None:
            _RECORDS.pop(key, None)


@functools.lru_cache(maxsize=1)
def placeholder_ban():
    """The vLLM logits processor class (built on first use: it subclasses vLLM's)."""
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

    class PlaceholderBan(LogitsProcessor):
        """Bans each flagged request's placeholder tokens and records, per completion
        position, ``logsumexp(l / T) - logsumexp(l_allowed / T)`` (what vLLM's processed
        log-probs lose to the ban). Not argmax-invariant: it runs before temperature, on
        fp32 logits, as vLLM's own bans do."""

        def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
            self.rows: dict[int, tuple[str, list]] = {}  # batch index -> (record key, live output ids)

        @classmethod
        def validate_params(cls, sampling_params) -> None:
            return None

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update: BatchUpdate | None) -> None:
            if batch_update is None:
                return
            for index in batch_update.removed:
                self.rows.pop(index, None)
            for index, params, _, output_ids in batch_update.added:
                key = (getattr(params, "extra_args", None) or {}).get(BAN_KEY)
                if key is None or key not in _RECORDS:
                    self.rows.pop(index, None)
                else:
                    self.rows[index] = (key, output_ids)
            for a, b, kind in batch_update.moved:
                moving = self.rows.pop(a, None)
                other = self.rows.pop(b, None)
                if kind == MoveDirectionality.SWAP and other is not None:
                    self.rows[a] = other
                if moving is not None:
                    self.rows[b] = moving

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            for index, (key, output_ids) in self.rows.items():
                record = _RECORDS.get(key)
                if record is None or index >= logits.shape[0]:
                    continue
                banned = torch.tensor(record["banned"], dtype=torch.long, device=logits.device)
                t = record["temperature"]
                row = logits[index].float() / (t if t > 1e-5 else 1.0)
                full = torch.logsumexp(row, dim=-1)
                row = row.index_fill(0, banned, -math.inf)
                record["shift"][len(output_ids)] = float(full - torch.logsumexp(row, dim=-1))
                logits[index].index_fill_(0, banned, -math.inf)
            return logits

    return PlaceholderBan
