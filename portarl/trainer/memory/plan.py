"""Peak memory of a training run per device, estimated before any weights load
(``portarl plan``, and one line at the start of ``portarl train``).

All sizes in bytes, per device. Notation: N parameters (N_t trainable: all, or the LoRA
adapter's), L layers, H hidden, I MLP width, n_h / n_kv attention / KV heads of width d, V
vocabulary, b the bytes of ``precision.dtype`` (4 / 2), W devices (FSDP2 ranks), S the
longest sequence (longest prompt + ``rollout.max_new_tokens``).

Held for the whole run ("static"; the optimizer state from the first optimizer step on):
- parameters: N b on one process. FSDP2 shards them: N b_p / W, with b_p = 4 when fp32
  masters are kept (FSDP2 stores fp32 and computes in b), plus the unsharded working set
  it all-gathers: the root (embeddings, head, final norm; not resharded between forward
  and backward) and two decoder layers (the one computing and the one prefetched), in b.
- fp32 master weights (one process, b < 4, ``master_weights_fp32``): 4 N_t.
- optimizer state (AdamW: two moments per trainable parameter): 2 x 4 N_t with fp32
  masters (or fp32 parameters), 2 b N_t otherwise; / W under FSDP2.
- KL reference (``loss.kl_coef`` > 0 without LoRA: a frozen copy; with LoRA it is the
  model with its adapter off, no copy): N b, / W under FSDP2.
- reward models (``rewards: [{model: PATH}]``): their parameters at their dtype, on this
  device unless they name their own (:mod:`portarl.trainer.memory.reward_models`).
- the data set, on CPU only (host memory is the device there): the loaded examples and
  their encoded prompts, 520 B per example + 33 B per prompt token (tracemalloc).

Update phase, added to the static part:
- gradients: b N_t (one process; plus 4 N_t for the fp32 master gradients when masters are
  kept); FSDP2: 4 N_t / W when reduced in fp32 (masters), else b N_t / W, plus one
  unsharded layer's gradient in b before its reduce-scatter.
- saved activations of the largest micro-batch: its tokens are m = rows x S with rows =
  min(micro_batch_size, max(1, max_tokens_per_micro_batch // S), sequences per device).
  Padding-free (``train.padding_free`` on and the attention packs, :mod:`portarl.trainer.
  packing`): the budget bounds the tokens the packed forward computes, not rows x the
  padded width, so m = min(min(micro_batch_size, sequences per device) x S,
  max(S, max_tokens_per_micro_batch)) (sequences shorter than S fill the budget's rest).
  One Llama / Qwen2 decoder layer keeps, per token, for its backward (eager autograd,
  SDPA attention), in elements:
    2 RMSNorms x (input + normalised output)                       4 H
    q and k after RoPE, v, the attention output and o_proj's input  3 n_h d + 2 n_kv d
    SwiGLU: gate, up, silu(gate), silu(gate) x up                   4 I
  a = 4 H + 3 n_h d + 2 n_kv d + 4 I. Without checkpointing all L layers keep a b m; with
  activation checkpointing each keeps its input (H b m) and one layer at a time rebuilds
  its a b m during the backward. The backward's own working set peaks in a layer's MLP:
  the gradients arriving at and leaving the layer (2 H) and those of the product, gate and
  up projections (3 I), beside the decoder's own tensors (embedding output, final norm, the
  completion hidden states and their gradient: 4 H): (6 H + 3 I) b m.
- attention masks of the largest micro-batch: sdpa's bool mask [rows, 1, S, S] (padded:
  transformers' dense mask; padding-free: at most the pairs ``DENSE_MASK_BOUND_BYTES``
  allows) plus the additive copy in b that SDPA makes per call and each layer keeps for its
  backward (L layers, 1 with checkpointing); eager one additive mask in b; flex a block
  mask; flash none (:func:`portarl.trainer.phases.attention_masks.planned_mask_bytes`).
- log-prob chunk buffers: :func:`portarl.ops.linear_logprobs` scores the completion rows in
  chunks of at most ``chunk_elements`` logits (fp32; logits, softmax and gradient: 3 of
  them; 4 MiB per buffer on CPU, 64 MiB on accelerators).

Optimizer step, added to the static part: the gradients; the guard's snapshot of what the
step writes (``guards.update_snapshot``: a copy of the optimizer's parameters and of its
state, so a non-finite update can be undone); with the foreach AdamW (FSDP2's DTensors,
``optim.implementation=foreach``) one temporary per parameter (sqrt of the second moment);
the fused AdamW (one process on CPU / CUDA) has none. On the first step the state does not
exist before the step: it is created here, and the snapshot holds the parameters only.

Rollout phase, added to the static part (no gradients; the decode is chunked by
``rollout.max_batch_size``, so only one chunk of c sequences is live):
- KV cache: c S L 2 n_kv d b (preallocated for the whole length by the lean decode).
- prefill: one layer's working set at a time, c P (2 H + n_h d + 2 n_kv d + 3 I) b, and the
  last position's logits and sampling buffers, 3 c V x 4.

With ``rollout.engine: vllm``, or in async mode, the engine's share replaces these (held
the whole run or in the rollout phase, by its sleep level): :mod:`portarl.trainer.memory.engine`.

A vision-language model adds its vision tower's weights, gradients and optimizer state
(only what trains: ``model.freeze_vision`` / ``model.train_projector``), the tower's
activations and the pixel buffers of the micro-batch and of the rollout chunk, and, on CPU,
the cache of prompts' pixels; its image tokens are in the prompt lengths
(:mod:`portarl.trainer.memory.vision`). A mixture-of-experts model counts all its experts'
weights, its activations by the width a token goes through, and with routing replay the
recorded experts (:mod:`portarl.trainer.memory.moe`; added to the update phase). The optimizer step and the KL reference count the
tower with the rest.

Sequence parallelism (``train.sequence_parallel_size`` SP > 1, Ulysses): the W ranks form
W / SP data-parallel groups, which split the prompts (sequences per device are per group);
the token budget is per rank, so a group's micro-batch holds up to SP x the budget and each
rank computes m / SP of its tokens: the saved activations, the backward working set and the
log-prob buffers are per rank's m / SP. The attention runs over whole rows (heads / SP of
them) under the rows' mask, one byte per query-key pair: about m x S bytes (rows of the
longest sequence), counted as "attention mask (sequence parallel)" unless the micro-batch is
one sequence (plain causal attention, no mask).

Peak = static + max(update, optimizer step, rollout). The no-grad scoring forwards (old /
reference log-probs) need one layer's working set of one micro-batch, less than the update's.

Checked against measured peak RSS increases on CPU (``portarl bench memory``): see
``docs/memory.md``. Not counted: the Python / torch runtime itself (measured as the
baseline), allocator fragmentation, and the model load's transient copies (a GGUF file is
dequantised tensor by tensor).
"""

from __future__ import annotations

import dataclasses
import re

from portarl.trainer.memory.arch import Arch, arch_of, prompt_stats
from portarl.trainer.memory.engine import engine_memory
from portarl.trainer.memory.moe import moe_lines, moe_parts
from portarl.trainer.memory.reward_models import reward_model_memory
from portarl.trainer.memory.vision import ImageStats, vision_parts

CPU_CHUNK_BYTES = 4 << 20
#: Host memory of one loaded example (the Example object, its prompt and answer strings)
#: and of one token of its encoded prompt (a list entry, a dict slot share, the int):
#: tracemalloc on the synthetic arithmetic data, 520 B and 33 B.
DATA_EXAMPLE_BYTES, DATA_TOKEN_BYTES = 520, 33
ACCEL_CHUNK_BYTES = 64 << 20
_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclasses.dataclass
class Plan:
    """Per-device estimate: ``parts`` (bytes, by name), the phase that peaks, and advice."""

    arch: Arch
    devices: int
    parts: dict
    static: int
    update: int
    rollout: int
    optimizer: int
    micro_batch_rows: int
    sequence_tokens: int
    checkpointing: bool
    micro_batch_tokens: int  # per rank (a sequence-parallel group's micro-batch / SP)
    padding_free: bool
    activations_other: int  # saved activations with checkpointing flipped, for the table
    device_memory: int | None = None
    notes: list = dataclasses.field(default_factory=list)  # the rollout engine's share, explained
    images: ImageStats | None = None  # a vision-language model's data
    trainable: int = 0  # parameters the optimizer updates (the tower's trainable ones included)
    model_lines: list = dataclasses.field(default_factory=list)  # a mixture-of-experts model's counts
    sequence_parallel: int = 1  # train.sequence_parallel_size

    @property
    def phases(self) -> dict:
        return {"update": self.update, "optimizer step": self.optimizer, "rollout": self.rollout}

    @property
    def peak(self) -> int:
        return self.static + max(self.phases.values())

    @property
    def phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory is None else self.peak <= self.device_memory


def _lora_params(arch: Arch, lora) -> int:
    """Adapter parameters: r x (in + out) per targeted linear of every layer."""
    h, q, kv, i = arch.hidden, arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim, arch.intermediate
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
              "up_proj": (h, i), "down_proj": (i, h)}
    targets = shapes if lora.target_modules == "all-linear" else {k: v for k, v in shapes.items()
                                                                   if k in lora.target_modules}
    return arch.layers * sum(lora.r * (a + b) for a, b in targets.values())


def layer_activation_elements(arch: Arch) -> int:
    """``a``: elements one decoder layer saves per token for its backward (module docstring)."""
    return 4 * arch.hidden + 3 * arch.heads * arch.head_dim + 2 * arch.kv_heads * arch.head_dim + 4 * arch.intermediate


def estimate(cfg, arch: Arch, *, prompt_tokens: int, devices: int = 1, device_memory: int | None = None,
             accelerator: bool = False, first_step: bool = False, examples: int = 0, data_tokens: int = 0,
             images: ImageStats | None = None) -> Plan:
    """The per-device plan for config ``cfg`` (a TrainConfig) on ``devices`` devices.
    ``first_step``: the run's first step, before which no optimizer state exists (what a
    one-step measurement sees); default the steady state. ``examples`` / ``data_tokens``:
    the data set's size (counted on CPU only, where host memory is the device's).
    ``images``: a vision-language model's data (:mod:`portarl.trainer.memory.vision`)."""
    from portarl.trainer.memory.checkpointing import wants_checkpointing
    from portarl.trainer.phases.attention_masks import planned_mask_bytes

    b = _BYTES[cfg.precision.dtype]
    w = max(1, devices)
    sharded = w > 1
    lora = cfg.model.lora
    n, l = arch.params, arch.layers
    n_t = _lora_params(arch, lora) if lora is not None else n
    masters = cfg.precision.use_master and b < 4
    b_opt = 4 if masters or b == 4 else b  # the optimizer's parameters and state
    # The largest micro-batch and the rollout's decode chunk.
    s = prompt_tokens + cfg.rollout.max_new_tokens
    sp = cfg.train.sequence_parallel_size if sharded else 1  # a group of SP ranks shares its rows
    per_device = cfg.train.prompts_per_step // max(1, w // sp) * cfg.rollout.group_size
    budget = cfg.train.max_tokens_per_micro_batch
    budget = budget * sp if budget else budget  # per rank: a group's micro-batch holds SP x the budget
    rows = min(cfg.train.micro_batch_size, per_device, max(1, budget // s) if budget else per_device)
    m = rows * s
    packed = plans_padding_free(cfg)
    if packed:
        rows = min(cfg.train.micro_batch_size, per_device)
        m = min(rows * s, max(s, budget)) if budget else rows * s
    group_tokens, m = m, -(-m // sp)  # each rank of the group computes 1 / SP of the tokens
    ckpt = wants_checkpointing(cfg)
    r = cfg.rollout
    sequences = cfg.train.prompts_per_step * r.group_size if r.mode == "async" else per_device  # one worker: whole steps
    c = min(r.max_batch_size or sequences, sequences)
    # A vision-language model's tower, image tokens and pixels (none for a text model).
    vision = {} if arch.vision is None else vision_parts(
        arch.vision, cfg.model, images, b=b, devices=w, masters=masters, b_opt=b_opt, rows=rows, chunk=c,
        checkpointing=ckpt, accelerator=accelerator)
    nv, nv_t = arch.vision_params, 0 if arch.vision is None else arch.vision.trainable(cfg.model)
    parts: dict[str, int] = {}

    def beside(*names):  # the vision lines next to the text model's
        parts.update({name: vision[name] for name in names if name in vision})

    if sharded:
        parts["parameters"] = n * (4 if masters else b) // w + (arch.root_params + 2 * arch.layer_params) * b
        beside("vision tower weights")
    else:
        parts["parameters"] = n * b
        beside("vision tower weights")
        parts["fp32 master weights"] = 4 * (n_t + nv_t) if masters else 0
    parts["KL reference"] = (n + nv) * b // w if cfg.loss.kl_coef > 0 and lora is None else 0
    state = 2 * n_t * b_opt // w
    parts["optimizer state"] = state
    beside("vision tower optimizer state")
    state += vision.get("vision tower optimizer state", 0)
    rm_parts, rm_notes = reward_model_memory(cfg)
    parts.update(rm_parts)
    # PPO's value model (fp32, its own AdamW; with LoRA the adapter trains) and a distillation teacher
    # (the run's dtype, a whole copy on each device): held all run long (trainer/phases/critic.py, distill.py).
    critic = cfg.loss.advantage_estimator == "gae"
    parts["value model (critic)"] = 4 * n // w if critic else 0
    parts["value model optimizer state"] = 2 * 4 * n_t // w if critic else 0
    parts["distillation teacher"] = n * b if cfg.loss.distill is not None else 0
    parts["data set (host)"] = 0 if accelerator else examples * DATA_EXAMPLE_BYTES + data_tokens * DATA_TOKEN_BYTES
    beside("pixel cache (host)")
    held = sum(parts.values()) - (state if first_step else 0)
    # Update phase: forward / backward of the largest micro-batch.
    a = layer_activation_elements(arch)
    full, checkpointed = l * a * b * m, (l * arch.hidden + a) * b * m
    if sharded:
        grads = n_t * (4 if masters else b) // w + arch.layer_params * b
    else:
        grads = n_t * b + (4 * n_t if masters else 0)
    parts["gradients"] = grads
    beside("vision tower gradients")
    grads += vision.get("vision tower gradients", 0)
    parts["saved activations"] = checkpointed if ckpt else full
    beside("vision tower activations")
    parts["backward working set"] = (6 * arch.hidden + 3 * arch.intermediate) * b * m
    chunk = ACCEL_CHUNK_BYTES if accelerator else CPU_CHUNK_BYTES
    parts["log-prob chunk buffers"] = 3 * min(chunk, m * arch.vocab * 4)
    parts["attention mask"] = planned_mask_bytes(cfg.model.attn_implementation, packed, rows, s, m, b,
                                                 1 if ckpt else l)
    beside("pixel buffers (micro-batch)")
    replay = {} if arch.moe is None else moe_parts(arch.moe, cfg, samples=sequences, rows=per_device, width=s,
                                                   accelerator=accelerator)
    parts.update(replay)
    parts["attention mask (sequence parallel)"] = group_tokens * s if sp > 1 and group_tokens > s else 0
    update = grads + sum(parts.get(k, 0) for k in ("saved activations", "backward working set", "log-prob chunk buffers",
                                                   "attention mask",
                                                   "vision tower activations", "pixel buffers (micro-batch)", *replay,
                                                   "attention mask (sequence parallel)"))
    # Optimizer step: gradients, the state it creates on the first step, the guard's
    # snapshot of what it writes, foreach temporaries (one per parameter: sqrt of v).
    n_t += nv_t  # the optimizer's parameters: the tower's trainable ones too
    snapshot = cfg.guards.update_snapshot or (b < 4 and not masters)
    parts["update snapshot"] = (n_t * b_opt // w + (0 if first_step else state)) if snapshot else 0
    foreach = sharded or cfg.optim.implementation == "foreach"
    parts["optimizer temporaries"] = n_t * b_opt // w if foreach else 0
    optimizer = grads + parts["update snapshot"] + parts["optimizer temporaries"] + (state if first_step else 0)
    # Rollout: the hf engine's tensors in the rollout phase, or vLLM's share of the device
    # (held or in the rollout phase by its sleep level); async workers hold theirs all along.
    hf = _hf_rollout(arch, c, s, prompt_tokens, b) if r.engine == "hf" else {}
    hf.update({k: vision[k] for k in ("pixel buffers (rollout)", "rollout vision tower forward") if k in vision and hf})
    engine = engine_memory(cfg, (n + nv) * b, hf, device_memory=device_memory, accelerator=accelerator)
    parts.update(engine.held)
    parts.update(engine.rollout)
    held += sum(engine.held.values())
    rollout = sum(engine.rollout.values())
    return Plan(arch, w, parts, held, update, rollout, optimizer, rows, s, ckpt, m, packed,
                full if ckpt else checkpointed, device_memory, engine.notes + rm_notes, images, n_t,
                moe_lines(arch, cfg, samples=sequences, rows=per_device, width=s), sp)


def _hf_rollout(arch: Arch, c: int, s: int, prompt_tokens: int, b: int) -> dict:
    """The hf engine's rollout tensors for a decode chunk of ``c`` sequences (module docstring)."""
    kv, q = arch.kv_heads * arch.head_dim, arch.heads * arch.head_dim
    return {"rollout KV cache": c * s * arch.layers * 2 * kv * b,
            "rollout prefill + sampling": (c * prompt_tokens * (2 * arch.hidden + q + 2 * kv + 3 * arch.intermediate) * b
                                           + 3 * c * arch.vocab * 4)}


def plans_padding_free(cfg) -> bool:
    """Whether the trainer will pack micro-batches: ``train.padding_free`` not false and
    an attention implementation transformers packs (the plan loads no model)."""
    from portarl.trainer.phases.packing import MASK_ATTENTION, VARLEN_ATTENTION

    impl = cfg.model.attn_implementation or "sdpa"
    return cfg.train.padding_free is not False and impl in MASK_ATTENTION + VARLEN_ATTENTION


def estimate_for_config(cfg, *, devices: int = 1, device_memory: int | None = None, accelerator: bool = False,
                        first_step: bool = False) -> Plan:
    """:func:`estimate` with the model's shape and the longest prompt read from ``cfg``."""
    stats = prompt_stats(cfg)
    return estimate(cfg, arch_of(cfg.model), prompt_tokens=stats.longest, devices=devices, device_memory=device_memory,
                    accelerator=accelerator, first_step=first_step, examples=stats.examples, data_tokens=stats.tokens,
                    images=stats.images)


def parse_size(text: str) -> int:
    """``80GiB``, ``64GB``, ``512MiB``, ``1.5TiB`` or a number of bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", str(text), flags=re.IGNORECASE)
    if not match:
        raise ValueError(f"--device-memory {text!r}: expected a size such as 80GiB or 64GB")
    value, unit, binary = float(match.group(1)), match.group(2).upper(), bool(match.group(3))
    power = "KMGT".index(unit) + 1 if unit else 0
    return int(value * (1024 if binary else 1000) ** power)


__all__ = ["Plan", "estimate", "estimate_for_config", "layer_activation_elements", "parse_size",
           "plans_padding_free"]
