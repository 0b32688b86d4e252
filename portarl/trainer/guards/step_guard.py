"""The trainer's guards in one place: which tensors are checked, in what order, how ranks
agree on a failure, how a skipped iteration is counted, and the spike judgment.

Order of the checks in an iteration (the first failure names the step's bad tensor):
``logits`` (blamed when old log-probs are non-finite because the model itself produced
NaN/inf), ``reward``, ``old_logp``, ``ref_logp``, ``advantage``; then per optimizer step
``loss``, ``gradient`` (fp16 dynamic scaling: an overflow, not a failure), the spike
detectors (``grad_norm_spike``, ``kl_spike``; act only with ``guards.spike_action``
skip / stop), ``optimizer_update`` (parameters and optimizer state after the step, and
with fp32 masters the cast back into the model's dtype, before it is written). Last,
checkpoints: one whose weights are not finite is never written. With
``train.old_logprobs=auto`` on-policy there is no scoring forward: ``old_logp`` is checked
in the update, on each micro-batch's training forward, and judged before ``loss`` and
``gradient`` with the step's one host transfer, before anything is applied (a non-finite
``ref_logp`` found first still blames the trainer's logits when they are the cause).

Primitives (``check_finite``, the detectors) live in :mod:`portarl.trainer.guards.detectors`.
"""

from __future__ import annotations

import logging

import torch

from portarl.runtime import distributed as pdist
from portarl.trainer.guards.detectors import NonFiniteError, SpikeTripped, check_finite
from portarl.trainer.phases.sequences import nonfinite_logit_positions

log = logging.getLogger("portarl.train")

GUARD_ORDER = ("logits", "reward", "old_logp", "ref_logp", "advantage", "loss", "gradient", "optimizer_update")


class StepGuard:
    """Non-finite checks for one iteration. Single process: a failure raises at once.
    Several ranks: a failure is only recorded, and every rank learns of it at the next
    :meth:`sync` (they must all reach the same collectives)."""

    def __init__(self, dist):
        self.dist = dist
        self.pending: str | None = None
        self.events: list = []  # (kind, message, fields) raised inside the phases
        self.spiked = False
        self.lost_warned = False  # per iteration: one lost_updates event, not one per optimizer step

    def reset(self) -> None:
        self.pending = None
        self.events = []
        self.spiked = False
        self.lost_warned = False

    def record(self, name: str) -> None:
        if self.pending is None:
            self.pending = name

    def check(self, name: str, tensor: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        if not self.dist.enabled:
            check_finite(name, tensor, mask)
            return
        try:
            check_finite(name, tensor, mask)
        except NonFiniteError:
            self.record(name)

    def sync(self) -> None:
        if not self.dist.enabled:
            return
        none = len(GUARD_ORDER)
        code = GUARD_ORDER.index(self.pending) if self.pending else none
        self.pending = None
        first = pdist.first_code(self.dist, code)
        if first < none:
            raise NonFiniteError(GUARD_ORDER[first], "on at least one rank; every rank skips")

    def blame_logits(self, trainer, batch, logp: torch.Tensor) -> None:
        """When log-probs are non-finite, name the logits if they are the source (the model
        itself produced NaN/inf: overflow in the forward, corrupted weights)."""
        if self.dist.enabled:
            return  # an extra forward on one rank only would break FSDP's collectives
        rows = torch.nonzero((~torch.isfinite(logp) & batch.mask).any(dim=-1)).flatten()
        bad = nonfinite_logit_positions(trainer.model, batch.rows(rows), trainer.config.precision.logits)
        if bool(bad.any()):
            raise NonFiniteError("logits", f"{int(bad.sum())} positions in {rows.numel()} sequences")


def record_skip(trainer, err, metrics: dict, events: list) -> None:
    """The iteration applied no optimizer step (a guard tripped before or in the first one;
    a failed update was restored): count it, name the tensor."""
    trainer.precision.zero_grad()
    record_bad(trainer, err)
    metrics["guard/nonfinite_tensor"] = err.tensor_name
    events.append(("skipped_step", f"skipped the optimizer step: {err}; weights and optimizer state untouched", {}))


def record_bad(trainer, err) -> None:
    """An iteration with a refused optimizer step (all skipped, or a later one of several):
    it counts towards ``guards.max_consecutive_skips`` so a persistent fault stops the run."""
    trainer.skipped_total += 1
    trainer.consecutive_skips += 1
    if trainer.consecutive_skips == 1:
        trainer.streak_first_bad = err.tensor_name


def record_clean(trainer) -> None:
    trainer.consecutive_skips = 0
    trainer.streak_first_bad = None


def finish_metrics(trainer, metrics: dict, events: list, skipped: bool, overflow: bool) -> None:
    """Skip counters, lr, kl; the events raised inside the phases (spikes, non-finite
    current-policy log-probs, lost updates) join ``events``."""
    metrics["skipped"] = int(skipped)
    metrics["guard/skipped_total"] = trainer.skipped_total
    metrics["guard/consecutive_skips"] = trainer.consecutive_skips
    metrics["lr"] = trainer.scheduler.get_last_lr()[0]
    kl = metrics.get("kl/value", metrics.get("pg/approx_kl", float("nan")))
    metrics["kl"] = kl
    metrics.setdefault("grad_norm", float("nan"))
    metrics["guard/spike"] = int(trainer.guard.spiked)
    events[:0] = trainer.guard.events


def judge_spikes(trainer, sums: dict) -> None:
    """Feed this optimizer step's KL and pre-clip grad norm to the spike detectors, before
    the update is applied. Action ``log``: an event. ``skip``: also refuse the step
    (:class:`SpikeTripped`). ``stop``: refuse it and have the run loop stop with a
    checkpoint (``trainer.stop_reason``)."""
    g = trainer.config.guards
    kl = sums.get("kl/value", sums.get("pg/approx_kl", float("nan")))
    if trainer.dist.enabled:  # every rank must reach the same verdict: judge the rank mean (grad norm is global)
        kl = float(pdist.all_reduce(trainer.dist, torch.tensor([float(kl)]))[0]) / trainer.dist.world_size
    tripped = None
    for detector, value in ((trainer.kl_spikes, kl), (trainer.grad_spikes, sums["grad_norm"])):
        event = detector.update(value)
        if not event:
            continue
        trainer.guard.spiked = True
        tripped = tripped or event
        if event["reason"] == "ceiling":
            why = f"{value:.4g} > ceiling {event['threshold']:.4g}"
        else:
            why = f"{value:.4g} > median {event['median']:.4g} + {g.spike_factor:g} x MAD {event['mad']:.3g}"
        event["action"] = g.spike_action  # the log level follows it (runlog.event_level)
        trainer.guard.events.append((event["kind"], f"{detector.name} spike: {why} (spike_action={g.spike_action})",
                                     event))
    if tripped is None or g.spike_action == "log":
        return
    if g.spike_action == "stop":
        trainer.stop_reason = tripped["kind"]
    raise SpikeTripped(tripped["kind"], f"{tripped['kind']} ({tripped['value']:.4g}, spike_action={g.spike_action})")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _all_finite(tensors) -> list[bool]:
    """Per tensor: all values finite. One foreach 2-norm over the list and one host sync
    instead of two ops per tensor: the check runs on every parameter and optimizer state
    tensor after each step. A NaN or inf always makes the norm non-finite; a finite tensor
    whose norm overflows (fp32 values beyond ~1e19, or an fp16 norm beyond 65504) is
    rechecked exactly with ``isfinite``, so it is never misjudged. (The max-abs norm cannot
    overflow, but torch's CPU kernel for it is 3x slower than the 2-norm's.)"""
    tensors = [_local(t) for t in tensors]
    flags = [True] * len(tensors)
    index = [i for i, t in enumerate(tensors) if t.numel()]  # an empty tensor has nothing to check
    if index:
        norms = torch._foreach_norm([tensors[i] for i in index], 2)
        for i, ok in zip(index, torch.isfinite(torch.stack([n.float() for n in norms])).cpu().tolist()):
            flags[i] = ok or bool(torch.isfinite(tensors[i]).all())
    return flags


class UpdateSnapshot:
    """What the optimizer step writes: the optimizer's parameters (fp32 masters, or the
    parameters themselves) and its per-parameter state. Taken just before the step so a
    non-finite result can be undone bitwise. Costs one copy of the optimizer's parameters
    and state while the step runs (``guards.update_snapshot=false`` saves it; a bad update
    then stops the run instead)."""

    def __init__(self, optimizer, targets):
        self.targets = targets
        with torch.no_grad():
            self.values = [t.detach().clone() for t in targets]
        self.state = []
        for t in targets:
            st = optimizer.state.get(t)
            self.state.append(None if not st else {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()})

    @torch.no_grad()
    def restore(self, optimizer) -> None:
        for t, value, st in zip(self.targets, self.values, self.state):
            t.copy_(value)
            if st is None:
                optimizer.state.pop(t, None)
            else:
                optimizer.state[t] = {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}


def lost_fraction(snapshot: UpdateSnapshot, optimizer) -> float:
    """Share of parameter values with a non-zero AdamW direction (exp_avg != 0) that the
    step left unchanged: updates below the parameters' resolution (bf16 without fp32
    master weights), lost without a trace otherwise."""
    moving = lost = 0
    for t, before in zip(snapshot.targets, snapshot.values):
        avg = optimizer.state.get(t, {}).get("exp_avg")
        if avg is None:
            continue
        nz = _local(avg) != 0
        moving += int(nz.sum())
        lost += int((nz & (_local(t) == _local(before))).sum())
    return lost / moving if moving else 0.0


def guarded_optimizer_step(trainer) -> dict:
    """``optimizer.step()`` with the parameters and optimizer state checked afterwards (and,
    with fp32 masters, before the low-precision parameters are written from them). A
    non-finite value restores the pre-step snapshot and raises ``NonFiniteError``
    naming ``optimizer_update`` and the first bad parameter. Returns metrics
    (``update/lost_frac`` when the optimizer steps low-precision parameters)."""
    precision, optimizer, dist = trainer.precision, trainer.optimizer, trainer.dist
    targets = precision.optimizer_params()
    take = trainer.config.guards.update_snapshot or precision.lossy  # lossy: lost_frac compares with it
    snap = UpdateSnapshot(optimizer, targets) if take else None
    optimizer.step()
    watched = list(targets)
    for t in targets:
        watched.extend(v for v in optimizer.state.get(t, {}).values() if torch.is_tensor(v) and v.is_floating_point())
    everything = _all_finite(watched)  # parameters and state in one host transfer
    flags, state_ok = everything[: len(targets)], all(everything[len(targets):])
    bad_index = next((i for i, ok in enumerate(flags) if not ok), None)
    if bad_index is None and not state_ok:
        bad_index = next(i for i, t in enumerate(targets)
                         if not all(_all_finite(v for v in optimizer.state.get(t, {}).values()
                                                if torch.is_tensor(v) and v.is_floating_point())))
    if bad_index is None and precision.use_master and precision.dtype == torch.float16:
        # fp16: a finite fp32 master beyond 65504 casts to inf.
        casted = _all_finite(m.to(p.dtype) for p, m in zip(precision.params, precision.masters))
        bad_index = next((i for i, ok in enumerate(casted) if not ok), None)
    bad_anywhere = pdist.any_rank(dist, bad_index is not None) if dist.enabled else bad_index is not None
    if bad_anywhere:
        name = trainer.param_names[bad_index] if bad_index is not None else "on another rank"
        if snap is None:
            raise UpdateUnrecoverable(f"non-finite optimizer_update (parameter {name}); guards.update_snapshot=false "
                                      "so it cannot be undone: stopping without a checkpoint of these weights")
        snap.restore(optimizer)
        raise NonFiniteError("optimizer_update", f"parameter {name}; parameters and optimizer state restored")
    precision.after_step()  # fp32 masters -> the model's parameters
    metrics = {}
    if precision.lossy and snap is not None:
        lost = metrics["update/lost_frac"] = lost_fraction(snap, optimizer)
        if lost > trainer.config.guards.lost_frac_warn and not trainer.guard.lost_warned:
            trainer.guard.lost_warned = True
            trainer.guard.events.append(("lost_updates", (
                f"{lost:.0%} of the parameter values AdamW moved did not change: the updates are below the "
                f"resolution of {str(precision.dtype).removeprefix('torch.')} (master_weights_fp32=false). Use "
                "precision.master_weights_fp32=auto (fp32 master weights) or a larger lr"), {"value": lost}))
    return metrics


class UpdateUnrecoverable(RuntimeError):
    """A non-finite optimizer update that could not be undone (no snapshot)."""


def first_nonfinite_weight(trainer) -> str | None:
    """Name of the first parameter (or fp32 master) holding NaN/inf; None when all are finite."""
    params = list(trainer.model.parameters())
    flags = _all_finite(params)
    for (name, _), ok in zip(trainer.model.named_parameters(), flags):
        if not ok:
            return name
    masters = trainer.precision.masters or []
    for name, ok in zip(trainer.param_names, _all_finite(masters)):
        if not ok:
            return f"{name} (fp32 master)"
    return None


def checkpoint_refusal(trainer) -> str | None:
    """Why the weights must not be checkpointed now (a parameter or fp32 master holds
    NaN/inf; collective under torchrun), or None. Logged as an error when refused."""
    bad = first_nonfinite_weight(trainer)
    if trainer.dist.enabled:  # collective: every rank calls any_rank, whatever it found
        anywhere = pdist.any_rank(trainer.dist, bad is not None)
        bad = bad or ("on another rank" if anywhere else None)
    if bad is None:
        return None
    latest = trainer.checkpoints.latest()
    log.error("refusing to write a checkpoint at step %d: non-finite weights (%s); the last good checkpoint is %s",
              trainer.step, bad, latest)
    return f"non-finite weights ({bad}); last good checkpoint: {latest}"
