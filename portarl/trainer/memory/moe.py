"""A mixture-of-experts model's share of the memory plan: its parameters (all of them, the
ones a token uses, the experts' own) and the routing-replay buffers, read from the config
before any weights load.

Why apart from the dense shape: an MoE layer's MLP is E experts of width I_e (gate, up and
down: 3 H I_e each), a router (E H) and, in Qwen2-MoE, a shared expert every token goes
through (3 H I_s) with its sigmoid gate (H). Only k of the E experts run for a token, so the
memory holds all E while the compute and the activations see k: the plan counts the
parameters whole and the activations by the active width k I_e + I_s (the arch's
``intermediate`` of an MoE model). Layers outside the MoE set (``mlp_only_layers``, or
off ``decoder_sparse_step``) keep a dense MLP of ``intermediate_size``.

Routing replay (``rollout.routing_replay: rollout``, :mod:`portarl.moe.routing`; with
``old`` only the device rows, which the trainer's old log-prob forward fills):
- host: the engine's record, per sample MoE layers x (prompt + completion tokens) x k
  int16 (2 bytes), for the rollout batch (the sequences a device rolls out per step);
  host memory, so counted in the peak on CPU only (where the host is the device), and
  printed always;
- device: the batch's :class:`portarl.moe.routing.RoutingRows`, ``experts`` [MoE layers,
  B, S, k] int64 and ``known`` [B, S] bool over the step's rows (built once in scoring,
  micro-batches take their rows from it), held through the update.

Families read: Qwen3-MoE, Qwen2-MoE (``num_experts``) and Mixtral-style configs
(``num_local_experts``, the experts' width in ``intermediate_size``).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class MoeShape:
    """A mixture-of-experts decoder's MLPs, as the plan needs them."""

    experts: int  # E routed experts per MoE layer
    top_k: int  # k experts per token
    expert_intermediate: int  # I_e, one expert's MLP width
    moe_layers: int  # decoder layers with an MoE block (the rest are dense)
    dense_intermediate: int  # the dense layers' MLP width
    shared_intermediate: int = 0  # I_s, the shared expert's width (Qwen2-MoE), 0: none
    shared_gate: bool = False  # the shared expert's sigmoid gate (Linear(H, 1))

    def expert_params(self, hidden: int) -> int:
        """One routed expert's parameters (gate, up, down)."""
        return 3 * hidden * self.expert_intermediate

    def block_params(self, hidden: int) -> int:
        """One MoE block: router, routed experts, the shared expert and its gate."""
        shared = 3 * hidden * self.shared_intermediate + (hidden if self.shared_gate else 0)
        return self.experts * hidden + self.experts * self.expert_params(hidden) + shared

    def mlp_params(self, hidden: int, layers: int) -> int:
        """Every layer's MLP: the MoE blocks and the dense MLPs."""
        return self.moe_layers * self.block_params(hidden) + (layers - self.moe_layers) * 3 * hidden * self.dense_intermediate

    def largest_mlp(self, hidden: int, layers: int) -> int:
        """The largest layer's MLP (what FSDP2 gathers whole)."""
        dense = 3 * hidden * self.dense_intermediate if layers > self.moe_layers else 0
        return max(self.block_params(hidden) if self.moe_layers else 0, dense)

    @property
    def active_intermediate(self) -> int:
        """The MLP width a token of an MoE layer goes through: k experts and the shared one."""
        return self.top_k * self.expert_intermediate + self.shared_intermediate

    def all_expert_params(self, hidden: int) -> int:
        """The routed experts' weights of the whole model."""
        return self.moe_layers * self.experts * self.expert_params(hidden)

    def inactive_params(self, hidden: int) -> int:
        """The routed experts a token does not use (E - k per MoE layer)."""
        return self.moe_layers * (self.experts - self.top_k) * self.expert_params(hidden)


def moe_shape_of(data: dict) -> MoeShape | None:
    """The :class:`MoeShape` of a transformers config (as a dict), or None for a dense one."""
    experts = int(data.get("num_experts") or data.get("num_local_experts") or 0)
    if experts <= 0:
        return None
    layers = int(data["num_hidden_layers"])
    step = int(data.get("decoder_sparse_step") or 1)
    dense_only = set(data.get("mlp_only_layers") or ())
    moe_layers = sum(1 for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
    dense = int(data["intermediate_size"])
    shared = int(data.get("shared_expert_intermediate_size") or 0)
    return MoeShape(experts=experts, top_k=int(data["num_experts_per_tok"]),
                    expert_intermediate=int(data.get("moe_intermediate_size") or dense), moe_layers=moe_layers,
                    dense_intermediate=dense, shared_intermediate=shared, shared_gate=shared > 0)


def replay_host_bytes(moe: MoeShape, tokens: int) -> int:
    """The engine's record of one sample of ``tokens`` (prompt + completion): int16."""
    return moe.moe_layers * tokens * moe.top_k * 2


def replay_device_bytes(moe: MoeShape, rows: int, width: int) -> int:
    """The batch's RoutingRows: ``experts`` [layers, rows, width, k] int64 and ``known`` [rows, width] bool."""
    return moe.moe_layers * rows * width * moe.top_k * 8 + rows * width


def moe_parts(moe: MoeShape, cfg, *, samples: int, rows: int, width: int, accelerator: bool) -> dict:
    """The routing-replay parts of the plan (module docstring): ``samples`` the rollout batch
    a device's engine records, ``rows`` the sequences a device scores and trains on per
    step, ``width`` their longest (prompt + completion) in tokens."""
    if cfg.rollout.routing_replay == "old":  # R2: the trainer records into the rows, no engine record
        return {"routing replay rows": replay_device_bytes(moe, rows, width)}
    if cfg.rollout.routing_replay != "rollout":
        return {}
    return {"routing replay rows": replay_device_bytes(moe, rows, width),
            "routing replay record (host)": 0 if accelerator else samples * replay_host_bytes(moe, width)}


def moe_lines(arch, cfg, *, samples: int, rows: int, width: int) -> list[str]:
    """The plan's lines of an MoE model: experts, total / active / expert parameters, and
    routing replay's buffers; none for a dense model."""
    from portarl.trainer.memory.engine import gib

    moe = arch.moe
    if moe is None:
        return []
    h = arch.hidden
    shared = f", a shared expert of width {moe.shared_intermediate}" if moe.shared_intermediate else ""
    lines = [f"mixture of experts: {moe.experts} experts of width {moe.expert_intermediate}, {moe.top_k} per token"
             f"{shared}, in {moe.moe_layers} of {arch.layers} layers",
             f"  parameters: {arch.params:,} in all, {arch.active_params:,} active per token; expert weights "
             f"{moe.all_expert_params(h):,} ({moe.experts * moe.expert_params(h):,} per MoE layer)"]
    if cfg.rollout.routing_replay == "rollout":
        lines.append(f"  routing replay: {replay_host_bytes(moe, width):,} bytes per sample recorded (host, int16), "
                     f"{gib(samples * replay_host_bytes(moe, width))} for the {samples} rollout samples; "
                     f"{gib(replay_device_bytes(moe, rows, width))} of RoutingRows for the step's {rows} rows on the "
                     "device (int64)")
    elif cfg.rollout.routing_replay == "old":
        lines.append(f"  routing replay (old policy's experts): {gib(replay_device_bytes(moe, rows, width))} of "
                     f"RoutingRows for the step's {rows} rows on the device (int64), recorded by the trainer")
    return lines


__all__ = ["MoeShape", "moe_lines", "moe_parts", "moe_shape_of", "replay_device_bytes", "replay_host_bytes"]
