"""Run settings: ``device:dtype[:variant][@section.field=value...]``.

The variant is an ops backend (``reference``, ``cuda``, ``npu``) or a numerics profile
(``npu-emulated``: EMULATION of an Ascend stack's documented numerics, see
:mod:`portarl.backends.emulation`). ``@`` overrides let the items users walk through when chasing
NPU spikes (clip range, learning rate, warm-up, batch size) sit side by side in one
comparison, e.g. ``cpu:bf16@optim.lr=1e-5@loss.clip_eps_high=0.2``.
"""

from __future__ import annotations

import dataclasses
import re

from portarl.backends.emulation import PROFILES, resolve_profile

METRICS = (
    ("reward/mean", "reward"),
    ("pg/loss", "policy loss"),
    ("kl", "KL"),
    ("grad_norm", "grad norm"),
    ("entropy", "entropy"),
    ("mismatch/abs_diff_mean", "|d logp| rollout vs trainer"),
    ("mismatch/kl_k3", "k3 KL(rollout || trainer)"),
    ("mismatch/masked_frac", "mismatch: fraction masked"),
)
BACKENDS = ("reference", "cuda", "npu")
DTYPES = ("fp32", "bf16", "fp16")


@dataclasses.dataclass(frozen=True)
class RunSpec:
    device: str
    dtype: str
    variant: str | None = None
    settings: tuple[str, ...] = ()  # per-run config overrides, "section.field=value"
    role: str = "run"  # "noise": the baseline repeated with another seed (noise floor)

    @property
    def label(self) -> str:
        base = ":".join(x for x in (self.device, self.dtype, self.variant) if x)
        text = "@".join([base, *self.settings])
        return text + ("#noise" if self.role == "noise" else "")

    @property
    def slug(self) -> str:
        """Directory name: ``cpu_bf16`` for ``cpu:bf16`` (others made filesystem-safe)."""
        return re.sub(r"[^A-Za-z0-9._=-]+", "_", self.label.replace(":", "_"))

    @property
    def emulated(self) -> bool:
        return self.variant is not None and self.variant in PROFILES and self.variant != "portarl"

    def overrides(self) -> list[str]:
        out = [f"device={self.device}", f"precision.dtype={self.dtype}"]
        if self.variant in BACKENDS:
            out.append(f"precision.backend={self.variant}")
        elif self.variant is not None:
            out.append(f"precision.numerics={self.variant}")
        return out + list(self.settings)

    def as_noise(self) -> "RunSpec":
        return dataclasses.replace(self, role="noise")

    @classmethod
    def from_label(cls, label: str) -> "RunSpec":
        noise = label.endswith("#noise")
        spec = parse_runs(label[: -len("#noise")] if noise else label)[0]
        return spec.as_noise() if noise else spec


def _parse_one(item: str) -> RunSpec:
    head, *settings = item.split("@")
    parts = head.split(":")
    if len(parts) not in (2, 3):
        raise ValueError(f"--runs entry {item!r}: use device:dtype[:backend-or-profile][@section.field=value...], "
                         "e.g. cpu:bf16:npu-emulated or cpu:bf16@optim.lr=1e-5")
    device, dtype = parts[0], parts[1]
    variant = parts[2] if len(parts) == 3 else None
    if dtype not in DTYPES:
        raise ValueError(f"--runs entry {item!r}: dtype must be fp32, bf16 or fp16")
    if variant is not None and variant not in BACKENDS:
        try:
            resolve_profile(variant)
        except ValueError:
            raise ValueError(
                f"--runs entry {item!r}: {variant!r} is neither a backend ({', '.join(BACKENDS)}) "
                f"nor a numerics profile ({', '.join(PROFILES)})"
            ) from None
    for s in settings:
        key, eq, _ = s.partition("=")
        if not eq or "." not in key or not all(key.split(".")):
            raise ValueError(f"--runs entry {item!r}: override {s!r} must be section.field=value, e.g. optim.lr=1e-5")
        if key.split(".")[0] in ("device", "precision") or key in ("output_dir", "model.path"):
            raise ValueError(f"--runs entry {item!r}: {key} is set by the run spec itself, not by an @ override")
    return RunSpec(device, dtype, variant, tuple(settings))


def parse_runs(text: str) -> list[RunSpec]:
    specs = [_parse_one(item) for item in (t.strip() for t in text.split(",")) if item]
    if not specs:
        raise ValueError("--runs lists no settings")
    if len({s.label for s in specs}) != len(specs):
        raise ValueError("--runs lists a setting twice")
    return specs


def check_run_devices(specs, option: str = "--runs") -> None:
    """Every device a stability run names must be here before the first run's warm-up
    starts (``npu:bf16`` on a machine without torch_npu used to fail 40 s in)."""
    from portarl.backends.device import DeviceUnavailableError, resolve_device

    for spec in specs:
        try:
            resolve_device(spec.device)
        except DeviceUnavailableError as err:
            raise ValueError(f"{option} {spec.label}: {err}") from None
