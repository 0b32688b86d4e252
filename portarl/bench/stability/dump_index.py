"""The on-disk form of a module dump: per-tensor summaries, safetensors shards, the JSON
index, and the same index in MindStudio Probe's module-level ("L0") ``dump.json`` layout.

Layout of a dump directory::

    index.json                      format, step, rank, environment, entries (call order)
    shard-00000.safetensors ...     the full tensors the size budget allowed
    step<N>/rank<R>/dump.json       the index as msprobe writes an L0 statistics dump

Every tensor is summarised (dtype, shape, min / max / mean / L2 norm over its finite
values, NaN and inf counts, CRC-32 of its raw bytes): two tensors with the same dtype,
shape and CRC-32 are taken as bit-equal (a 1-in-4-billion collision aside). Full tensors
are kept in call order until ``budget_mb`` is spent; later ones have their summary only.
Nothing here unpickles: JSON and safetensors.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch

FORMAT = "portarl-dump/1"
INDEX = "index.json"
SHARD_BYTES = 64 << 20


def raw_crc32(t: torch.Tensor) -> str:
    """CRC-32 (hex, 8 digits) of the tensor's raw bytes in C order: what msprobe stores in
    its ``md5`` field with ``summary_mode`` md5."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return f"{zlib.crc32(flat.view(torch.uint8).numpy().tobytes()) & 0xFFFFFFFF:08x}"


def summarise(t: torch.Tensor) -> dict:
    """dtype, shape, min / max / mean / L2 norm (float64, over finite values), NaN / inf
    counts and the CRC-32 of the raw bytes."""
    cpu = t.detach().to("cpu")
    x = cpu.double() if cpu.dtype != torch.bool else cpu.to(torch.float64)
    finite = torch.isfinite(x)
    v = x[finite]
    nan = int(torch.isnan(x).sum())
    return {
        "dtype": str(cpu.dtype), "shape": list(cpu.shape),
        "min": float(v.min()) if v.numel() else None, "max": float(v.max()) if v.numel() else None,
        "mean": float(v.mean()) if v.numel() else None, "norm": float(v.norm()) if v.numel() else None,
        "nan": nan, "inf": int(x.numel() - int(finite.sum()) - nan), "crc32": raw_crc32(cpu),
        "requires_grad": bool(t.requires_grad), "tensor": None,
    }


class ShardWriter:
    """Full tensors into ``shard-NNNNN.safetensors`` files while the budget lasts."""

    def __init__(self, out: Path, budget_bytes: int):
        self.out, self.left = out, budget_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[str] = []

    def offer(self, key: str, t: torch.Tensor) -> str | None:
        """Keep ``t`` when it fits the budget; returns its ``shard:key`` address or None."""
        size = t.numel() * t.element_size()
        if size > self.left:
            self.left = 0  # call order: once one does not fit, later ones get summaries only
            return None
        self.left -= size
        self.pending[key] = t.detach().to("cpu").contiguous().clone()
        self.pending_bytes += size
        name = f"shard-{len(self.shards):05d}.safetensors"
        if self.pending_bytes >= SHARD_BYTES:
            self.flush()
        return f"{name}:{key}"

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        name = f"shard-{len(self.shards):05d}.safetensors"
        save_file(self.pending, str(self.out / name), metadata={"format": FORMAT})
        self.shards.append(name)
        self.pending, self.pending_bytes = {}, 0


def msprobe_name(entry: dict) -> str:
    """``Module.<path>.<Class>.forward|backward.<n>`` (msprobe's L0 naming)."""
    return f"Module.{entry['name']}.{entry['class']}.{entry['direction']}.{entry['call']}"


def _msprobe_tensor(info: dict) -> dict:
    return {"type": "torch.Tensor", "dtype": info["dtype"], "shape": info["shape"], "Max": info["max"],
            "Min": info["min"], "Mean": info["mean"], "Norm": info["norm"], "requires_grad": info["requires_grad"],
            "md5": info["crc32"]}


def msprobe_layout(index: dict) -> dict:
    """The index as an msprobe L0 ``dump.json`` (task statistics, summary with ``md5``).

    Forward entries hold ``input_args`` / ``input_kwargs`` / ``output`` / ``parameters``;
    backward entries ``input`` (grads of the forward outputs) / ``output`` (grads of the
    forward inputs); parameter grads go in ``Module.<path>.<Class>.parameters_grad.<n>``.
    Statistics are over finite values (msprobe's are over all values); ``md5`` holds the
    CRC-32 of the raw bytes, as msprobe's own md5 mode does.
    """
    data: dict = {}
    for e in index["entries"]:
        key = msprobe_name(e)
        if e["direction"] == "forward":
            args = [_msprobe_tensor(i) for i, n in zip(e["inputs"], e["input_names"]) if not n.startswith("kw:")]
            kwargs = {n[3:]: _msprobe_tensor(i) for i, n in zip(e["inputs"], e["input_names"]) if n.startswith("kw:")}
            data[key] = {"input_args": args, "input_kwargs": kwargs,
                         "output": [_msprobe_tensor(i) for i in e["outputs"]],
                         "parameters": {k: _msprobe_tensor(v) for k, v in e["params"].items()}}
        else:
            data[key] = {"input": [_msprobe_tensor(i) for i in e["inputs"]],
                         "output": [_msprobe_tensor(i) for i in e["outputs"]]}
            if e["params"]:
                grads = f"Module.{e['name']}.{e['class']}.parameters_grad.{e['call']}"
                data[grads] = {k: [_msprobe_tensor(v)] for k, v in e["params"].items()}
    return {"task": "statistics", "level": "L0", "framework": "pytorch", "dump_data_dir": None, "data": data}


def write_index(out: Path, index: dict) -> Path:
    (out / INDEX).write_text(json.dumps(index, indent=1, default=str) + "\n")
    probe = out / f"step{index['step']}" / f"rank{index['rank']}"
    probe.mkdir(parents=True, exist_ok=True)
    (probe / "dump.json").write_text(json.dumps(msprobe_layout(index), indent=1) + "\n")
    return out / INDEX


class Dump:
    """A dump directory read back: its index, and its full tensors loaded on demand."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        path = self.dir / INDEX
        if not path.exists():
            raise FileNotFoundError(f"{directory} is not a portarl module dump (no {INDEX}); make one with "
                                    "portarl bench stability dump --out DIR")
        try:
            self.index = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON ({err}); re-run the dump") from None
        if self.index.get("format") != FORMAT:
            raise ValueError(f"{path}: format {self.index.get('format')!r}, expected {FORMAT!r}")
        self._shards: dict[str, object] = {}

    @property
    def entries(self) -> list[dict]:
        return self.index["entries"]

    def tensor(self, info: dict) -> torch.Tensor | None:
        """The full tensor behind a summary, or None when the budget left it out."""
        if not info.get("tensor"):
            return None
        from safetensors import safe_open

        shard, _, key = info["tensor"].partition(":")
        if shard not in self._shards:
            self._shards[shard] = safe_open(str(self.dir / shard), framework="pt")
        return self._shards[shard].get_tensor(key)
