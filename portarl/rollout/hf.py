"""The embedded rollout engine: a Hugging Face causal LM sampled with its KV cache.

Batched, prompts left-padded (position ids from the attention mask, as the trainer uses),
temperature / top-k / top-p, ``max_new_tokens``, stop on EOS or any of ``stop_token_ids``.
Sampling is written out rather than delegated to ``generate`` because each row needs its
own random stream: ``generate`` draws every row from one global stream, so results would
depend on batch composition and a fixed seed per request would make every sample of a
group identical. The stream is counter-based (Philox keyed by the sample seed, counter =
completion position and vocabulary index; :mod:`portarl.rollout.sampling`), so it is drawn
on the device for the whole batch at once.

Compute: with ``share_prefill`` (``rollout.share_prefill``), a prompt repeated in the batch
(the G samples of a group) is prefilled once and its KV-cache rows copied
(:meth:`HFRollout._prefill`); Llama-family models decode through
:mod:`portarl.rollout.lean_decode` (no per-token mask building or cache re-copying), others
through the model's forward. Host traffic: the prefill computes
the head on the last position only (``logits_to_keep=1``
where the model accepts it); tokens, log-probs and stop flags stay on the device until the
end, and the only per-step transfer is one bool (are all rows done?) for the early stop.
"""

from __future__ import annotations

import inspect
import logging

import torch

from portarl import ops
from portarl.runtime.distributed import has_sharded_params
from portarl.rollout.base import RolloutBatch, RolloutEngine, SamplingParams
from portarl.rollout.lean_decode import LeanDecoder, unsupported_reason
from portarl.rollout.sampling import filter_logits, sample_tokens, seed_keys, uniform_span

#: Philox words drawn per call (about 8 MiB per int64 temporary): several positions per call
#: when B x V is small (a CPU pays per op, not per element), one position at a time otherwise.
#: The log-probs of those positions are computed together too (their logits kept meanwhile).
NOISE_WORDS_PER_CALL = 1 << 20

__all__ = ["HFRollout", "filter_logits", "left_pad"]

log = logging.getLogger("portarl.rollout")


def left_pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts left-padded to a common width, and their attention mask (one ``torch.tensor``
    call each: per-row tensors cost more than the decode step on small models)."""
    width = max(len(s) for s in seqs)
    ids = torch.tensor([[pad_id] * (width - len(s)) + list(s) for s in seqs], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], dtype=torch.long)
    return ids.to(device), mask.to(device)


def _per_sample_experts(calls: list, batch: RolloutBatch) -> list:
    """Each sample's recorded experts [layers, fed tokens, k] (int16) from the routers'
    calls (:func:`portarl.moe.routing.recording`): the prefill's rows (prompts left-padded
    to a common width), then one decode call per completion token fed (all but the last)."""
    n = len(batch.prompt_ids)
    width = max(len(p) for p in batch.prompt_ids)
    out = []
    for i, (prompt, completion) in enumerate(zip(batch.prompt_ids, batch.completion_ids)):
        fed = max(len(completion) - 1, 0)
        layers = []
        for per_call in calls:
            prefill = per_call[0].view(n, width, -1)[i, width - len(prompt):]
            steps = [per_call[1 + t][i : i + 1] for t in range(fed)]
            layers.append(torch.cat([prefill, *steps]) if steps else prefill)
        out.append(torch.stack(layers).cpu())
    return out


def _rows_of(media, rows: list[int]):
    """The vision inputs of ``rows`` (None without)."""
    return None if media is None else media.take(rows)


def _distinct_rows(prompts) -> tuple[list, list[int]]:
    """(the distinct prompts in first-seen order, each row's index into them)."""
    first: dict = {}
    row_of = [first.setdefault(tuple(p), len(first)) for p in prompts]
    return [list(p) for p in first], row_of


def _without_autograd(model):
    """``torch.inference_mode()`` (no version counters or view tracking: 7% of the decode of
    ``portarl bench step``'s model on CPU), or ``torch.no_grad()`` for FSDP2-sharded
    parameters, whose unsharded buffers are made by the first all-gather, maybe this one,
    and must stay usable by the training forward (an inference tensor is not)."""
    return torch.no_grad() if has_sharded_params(model.parameters()) else torch.inference_mode()


def _cache_argument(model) -> str:
    """The forward's name for the KV cache: ``cache`` (transformers >= 5.2x models that
    deprecate ``past_key_values``, the Qwen-VL ones among them) or ``past_key_values``."""
    get_base = getattr(model, "get_base_model", None)  # peft: its forward takes **kwargs
    base = get_base() if callable(get_base) else model
    try:
        names = inspect.signature(base.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - exotic wrappers
        return "past_key_values"
    return "cache" if "cache" in names and "past_key_values" not in names else "past_key_values"


def _cache_of(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _last_logits_kwargs(model) -> dict:
    """Ask the model for the last position's logits only (transformers >= 4.50 calls it
    ``logits_to_keep``, 4.45-4.49 ``num_logits_to_keep``); {} when it accepts neither."""
    try:
        names = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - exotic wrappers
        return {}
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in names:
            return {name: 1}
    return {}


class HFRollout(RolloutEngine):
    name = "hf"
    #: ``generate`` takes ``row_limits`` and ``stop_when`` (partial rollouts: :mod:`portarl.rollout.partial`).
    supports_stop_when = True

    def __init__(self, model: torch.nn.Module, eos_token_id: int, pad_token_id: int,
                 stop_token_ids: tuple[int, ...] | list[int] | None = None, lean_decode: bool = True,
                 share_prefill: bool = False, max_batch_size: int | None = None):
        """``stop_token_ids``: tokens that end a completion (kept in it, ``finished``);
        default ``(eos_token_id,)``. Pass e.g. eos plus a chat end-of-turn (``<|im_end|>``).
        ``lean_decode``: decode with :mod:`portarl.rollout.lean_decode` where it applies.
        ``share_prefill``: prefill a repeated prompt once (:meth:`_prefill`).
        ``max_batch_size``: generate at most this many sequences at once (``rollout.max_batch_size``;
        None: all): chunks run one after the other, each one's KV cache freed before the next."""
        if isinstance(eos_token_id, bool) or not isinstance(eos_token_id, int):
            raise TypeError(f"eos_token_id must be one token id (int), got {eos_token_id!r}; pass further stop tokens "
                            "(a chat end-of-turn such as <|im_end|>) as stop_token_ids=[...]")
        self.model = model
        #: ``flag -> bool``: whether every process is done (several FSDP ranks decode in
        #: lock step because each forward is collective). Default: this process alone.
        self.finished_everywhere = lambda flag: flag
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        stops = (eos_token_id,) if stop_token_ids is None else tuple(int(t) for t in stop_token_ids)
        if not stops:
            raise ValueError("stop_token_ids is empty: generation would only stop at max_new_tokens")
        self.stop_token_ids = tuple(dict.fromkeys(stops))
        self.lean_decode = lean_decode
        self.share_prefill = share_prefill
        self.decode_path: str | None = None  # "lean" or "hf (why not lean)", from the last generate
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"rollout.max_batch_size must be >= 1 or None, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        #: Record the experts each token was routed to (``rollout.routing_replay: rollout``;
        #: a mixture-of-experts model): ``RolloutBatch.routed_experts``. The prefill then
        #: runs every row (``share_prefill`` would prefill a group's prompt once).
        self.record_routing = False

    def samples_policy_of(self, model: torch.nn.Module) -> bool:
        """It samples from the module it was given: the trainer's own model, always current."""
        return self.model is model

    def generate(self, prompts, seeds, params: SamplingParams, media=None, row_limits=None,
                 stop_when=None, end_at=None) -> RolloutBatch:
        """``media`` (a vision-language model): the prompts' :class:`portarl.vision.inputs.
        VisionBatch`; the prefill then runs the vision tower and M-RoPE positions, decoding
        continues each row from its prompt's largest position plus one, and the image
        placeholder tokens are never drawn (``VisionBatch.unsampleable``).

        Partial rollouts (:mod:`portarl.rollout.partial`): ``row_limits``, each row's own
        token limit (at most ``params.max_new_tokens``: a row at it is done, unfinished);
        ``stop_when(done) -> bool``, called after each token with the rows' done flags (a
        bool tensor on the device): decoding stops where it says so, the rows not done
        returned with the tokens they have (``finished`` False). Both take one call over
        every row (at most ``rollout.max_batch_size`` rows). ``end_at``: per row, the token
        count after which it ends with the end-of-sequence token, or None (benchmark lengths:
        :mod:`portarl.rollout.bench_lengths`; by default read from ``PORTARL_BENCH_LENGTHS``)."""
        from portarl.rollout import bench_lengths

        if end_at is None and bench_lengths.spec():
            end_at = [bench_lengths.target_length(s) for s in seeds]
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if media is not None and len(media) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but vision inputs for {len(media)}")
        if row_limits is not None or stop_when is not None:
            if media is not None or self.record_routing:
                raise ValueError("row_limits / stop_when (partial rollouts) take no vision inputs or routing replay")
            if self.max_batch_size is not None and len(prompts) > self.max_batch_size:
                raise ValueError(f"row_limits / stop_when take one call over every row: {len(prompts)} rows, "
                                 f"rollout.max_batch_size {self.max_batch_size} (the pool sends at most that many)")
            if row_limits is not None and len(row_limits) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(row_limits)} row limits")
            with _without_autograd(self.model):
                return self._sample(prompts, seeds, params, None, row_limits, stop_when, end_at)
        size = self.max_batch_size or max(1, len(prompts))
        parts = []
        with _without_autograd(self.model):
            # Bounded memory: one chunk's KV cache at a time. Every sample has its own
            # random stream (seed), so a chunk samples what the whole batch would; ranks
            # hold equal numbers of prompts, so lock-step ranks run equal numbers of chunks.
            for start in range(0, len(prompts), size):
                chunk = None if media is None else media.take(range(start, min(start + size, len(prompts))))
                parts.append(self._generate(prompts[start:start + size], seeds[start:start + size], params, chunk,
                                            None if end_at is None else end_at[start:start + size]))
        if len(parts) == 1:
            return parts[0]
        merged = RolloutBatch(*(sum((getattr(p, f) for p in parts), []) for f in
                                ("prompt_ids", "completion_ids", "logprobs", "finished")))
        if self.record_routing:
            merged.routed_experts = sum((p.routed_experts for p in parts), [])
        return merged

    def _generate(self, prompts, seeds, params: SamplingParams, media=None, end_at=None) -> RolloutBatch:
        if self.record_routing:  # a mixture-of-experts model: the experts of every token fed (routing replay)
            from portarl.moe.routing import recording

            with recording(self.model) as calls:
                batch = self._sample(prompts, seeds, params, media, end_at=end_at)
            batch.routed_experts = _per_sample_experts(calls, batch)
            return batch
        return self._sample(prompts, seeds, params, media, end_at=end_at)

    def _sample(self, prompts, seeds, params: SamplingParams, media=None, row_limits=None,
                stop_when=None, end_at=None) -> RolloutBatch:
        model = self.model
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        try:
            keys = seed_keys(seeds, device)
            stops = torch.tensor(self.stop_token_ids, dtype=torch.long, device=device)
            banned = None if media is None or not media.unsampleable else \
                torch.tensor(media.unsampleable, dtype=torch.long, device=device)
            past, logits, mask, next_pos = self._prefill(prompts, device, media)
            decode, keep = self._decoder(past, mask, params.max_new_tokens - 1, vision=media is not None)
            n = len(prompts)
            tokens = torch.full((n, params.max_new_tokens), self.pad_token_id, dtype=torch.long, device=device)
            logps = torch.zeros((n, params.max_new_tokens), dtype=torch.float32, device=device)
            done = torch.zeros(n, dtype=torch.bool, device=device)
            length = torch.zeros(n, dtype=torch.long, device=device)  # tokens kept per row
            limits = None if row_limits is None else torch.tensor(row_limits, dtype=torch.long, device=device)
            at_limit = torch.zeros(n, dtype=torch.bool, device=device)  # done by its own limit, not a stop token
            ends = None if end_at is None else torch.tensor([-1 if e is None else e for e in end_at],
                                                            dtype=torch.long, device=device)
            vocab = logits.shape[-1]
            span = max(1, NOISE_WORDS_PER_CALL // (n * -(-vocab // 4)))
            noise, pending = None, []
            # The rows this step decodes: every row, or with partial rollouts (stop_when) the
            # rows not yet done once a quarter of them are (their KV cache rows dropped): a
            # pool decodes its long samples without carrying the finished rows along.
            rows, compact = slice(None), stop_when is not None and keep is not None
            for t in range(params.max_new_tokens):
                if not params.greedy and t % span == 0:
                    noise = uniform_span(keys, t, min(span, params.max_new_tokens - t), vocab)
                z = logits if banned is None else logits.index_fill(-1, banned, float("-inf"))
                if ends is not None:  # benchmark lengths: no stop token before the row's length (nor the model's own)
                    z = z.clone()
                    z[:, stops] = torch.where((length[rows] + 1 < ends[rows])[:, None], float("-inf"), z[:, stops])
                tok = sample_tokens(z, keys, t, temperature=params.temperature, top_k=params.top_k,
                                    top_p=params.top_p, greedy=params.greedy,
                                    u=None if params.greedy else noise[:, t % span])
                if ends is not None:  # benchmark lengths: the row's last token is the end-of-sequence token
                    tok = torch.where(length[rows] + 1 == ends[rows], torch.full_like(tok, self.eos_token_id), tok)
                tokens[rows, t] = tok
                pending.append(logits)
                if len(pending) >= span:
                    self._score(pending, tokens, logps, t + 1, params.temperature, rows)
                length[rows] += (~done[rows]).long()
                done[rows] |= (tok[:, None] == stops).any(-1)
                if limits is not None:
                    at_limit[rows] |= ~done[rows] & (length[rows] >= limits[rows])
                    done |= at_limit
                # The last position's token needs no forward after it (nothing samples from
                # its logits); every rank skips it alike, so lock-step ranks stay matched.
                if t + 1 == params.max_new_tokens or self.finished_everywhere(bool(done.all())):
                    break
                if stop_when is not None and stop_when(done):
                    break
                if compact and 4 * int(done[rows].sum()) >= done[rows].numel():
                    self._score(pending, tokens, logps, t + 1, params.temperature, rows)
                    kept = (~done[rows]).nonzero().squeeze(1)
                    keep(kept)
                    rows = kept if isinstance(rows, slice) else rows[kept]
                    tok, next_pos, keys = tok[kept], next_pos[kept], keys[kept]
                    noise = None if noise is None else noise[kept]
                logits = decode(tok[:, None], next_pos)
                next_pos = next_pos + 1
            self._score(pending, tokens, logps, t + 1, params.temperature, rows)
            # One host transfer each, then plain list slicing (no per-row tensor ops).
            tokens, logps, length, done = tokens.tolist(), logps.tolist(), length.tolist(), (done & ~at_limit).tolist()
            completions = [row[:k] for row, k in zip(tokens, length)]
            logprobs = [row[:k] for row, k in zip(logps, length)]
            return RolloutBatch([list(p) for p in prompts], completions, logprobs, done)
        finally:
            model.train(was_training)

    def _decoder(self, past, mask, steps: int, vision: bool = False):
        """(``step(tokens [B, 1], positions [B, 1]) -> logits [B, V]`` for up to ``steps``
        tokens after the prefill, ``keep(rows)``: from now on decode only those rows, or None
        where the cache cannot drop rows): the lean step (:mod:`portarl.rollout.lean_decode`) where
        it reproduces the model and ``lean_decode`` is on, else the Hugging Face forward.
        ``decode_path`` says which, and why not lean (logged when it changes)."""
        reason = (unsupported_reason(self.model, mask.shape[1] + steps) if self.lean_decode
                  else "rollout.lean_decode is off")
        if vision:
            reason = "a vision-language model (M-RoPE)"
        path = "lean" if reason is None else f"hf ({reason})"
        if path != self.decode_path:  # nothing to act on for FSDP2-sharded weights: the trainer's own path
            log.log(logging.DEBUG if "FSDP2" in path else logging.INFO, "hf engine decode path: %s", path)
            self.decode_path = path
        if reason is None:
            lean = LeanDecoder(self.model, past, mask, steps)
            return lean.step, lean.keep
        state = {"past": past, "mask": mask}
        cache_name = _cache_argument(self.model)

        def hf_step(tokens, positions):
            state["mask"] = torch.cat([state["mask"], torch.ones_like(state["mask"][:, :1])], dim=1)
            out = self.model(input_ids=tokens, attention_mask=state["mask"], position_ids=positions,
                             use_cache=True, **{cache_name: state["past"]})
            state["past"] = _cache_of(out)
            return out.logits[:, -1]

        def hf_keep(rows: torch.Tensor) -> None:
            state["past"].reorder_cache(rows)
            state["mask"] = state["mask"][rows]

        return hf_step, (hf_keep if callable(getattr(past, "reorder_cache", None)) else None)

    def _prefill(self, prompts, device, media=None):
        """The prompts' forward: (KV cache, last-position logits, attention mask, next
        position ids), one row per prompt. With ``share_prefill``, a prompt that repeats (the
        G samples of a GRPO group) is computed once and its cache rows copied
        (``Cache.reorder_cache``, the beam-search reindexing), which divides prefill compute
        by the group size; a cache without ``reorder_cache`` gets the plain forward over
        every row. Off by default: the prefill's batch then depends on how many distinct
        prompts a process holds, and a matrix product over fewer rows may sum in another
        order (CPU GEMMs pick their kernel by size), so the rollout log-probs can move in the
        last bits between, say, one process and two ranks of the same run; AdamW's first
        step amplifies that for near-zero gradients beyond what
        ``tests/distributed/test_fsdp_gloo.py`` allows."""
        if self.share_prefill and not self.record_routing:
            # A vision prompt is its tokens and its images: equal tokens with other images are not equal.
            keys = prompts if media is None else [list(p) + [("vision", id(vp))] for p, vp in zip(prompts, media.prompts)]
            distinct, row_of = _distinct_rows(keys)
        else:
            distinct, row_of = prompts, None
        if len(distinct) < len(prompts):
            firsts = [row_of.index(k) for k in range(len(distinct))]
            past, logits, mask, following = self._forward_prompts([prompts[i] for i in firsts], device,
                                                                   _rows_of(media, firsts))
            if callable(getattr(past, "reorder_cache", None)):
                index = torch.tensor(row_of, dtype=torch.long, device=device)
                past.reorder_cache(index)
                return past, logits[index], mask[index], following[index]
        past, logits, mask, following = self._forward_prompts(prompts, device, media)
        return past, logits, mask, following

    def _forward_prompts(self, prompts, device, media=None):
        """(cache, last logits, mask, each row's next position [B, 1])."""
        ids, mask = left_pad(prompts, self.pad_token_id, device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        following = positions[:, -1:] + 1
        kwargs = {"position_ids": positions}
        if media is not None:
            rows = media.rows([len(p) for p in prompts], [0] * len(prompts), ids.shape[1], 0, device)
            kwargs = rows.padded_kwargs(ids)
            following = torch.tensor([[vp.next_position] for vp in media.prompts], dtype=torch.long, device=device)
        out = self.model(input_ids=ids, attention_mask=mask, use_cache=True, **kwargs,
                         **_last_logits_kwargs(self.model))
        return _cache_of(out), out.logits[:, -1], mask, following

    @staticmethod
    def _score(pending: list, tokens: torch.Tensor, logps: torch.Tensor, end: int, temperature: float,
               rows=slice(None)) -> None:
        """Log-probs of the tokens at positions end - len(pending) .. end - 1, one
        :func:`portarl.ops.logprobs` call for those positions (row-wise, so the same values
        as one call per position); empties ``pending``."""
        if not pending:
            return
        start = end - len(pending)
        logits = pending[0][:, None] if len(pending) == 1 else torch.stack(pending, dim=1)
        logps[rows, start:end] = ops.logprobs(logits, tokens[rows, start:end], temperature=temperature).float()
        pending.clear()
