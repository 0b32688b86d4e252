"""Per-module dump of one training forward + backward: ``dump_modules(model, batch, out)``.

Why: two machines' runs part at some step (``bench stability compare`` says when); to say
*where* (which layer, which op), both machines run the same step's forward and backward
with every module hooked, and :func:`portarl.bench.stability.locator.locate` compares the
two dumps module by module.

What is recorded, per module call (forward hooks with kwargs, full backward hooks):

- forward: the inputs (positional and keyword tensors, nested tuples flattened), the
  output(s), the module's own parameters (not its children's);
- backward: the grads of its outputs (``inputs`` of the backward entry, as msprobe names
  them), the grads of its positional inputs (``outputs``), and after the backward its own
  parameters' grads;
- portarl's ops (log-probs, KL, loss) through :meth:`Tap.record` in the step function: the
  op's output and the inputs named there, and the grad of its output.

Each call gets a global ``order`` (forward calls in execution order, then backward calls in
the order autograd runs them) and a per-module ``call`` number. Files: see
:mod:`portarl.bench.stability.dump_index`.
"""

from __future__ import annotations

import fnmatch
import shutil
import warnings
from pathlib import Path
from typing import Callable

import torch

from portarl.bench.stability.dump_index import FORMAT, ShardWriter, summarise, write_index


def _flatten(value, prefix: str) -> list[tuple[str, torch.Tensor]]:
    """Tensors inside ``value`` (tensor, tuple / list, dict, HF ModelOutput) with labels."""
    if isinstance(value, torch.Tensor):
        return [(prefix, value)]
    if isinstance(value, dict) or hasattr(value, "to_tuple") and hasattr(value, "items"):
        return [t for k, v in value.items() for t in _flatten(v, f"{prefix}.{k}")]
    if isinstance(value, (tuple, list)):
        return [t for i, v in enumerate(value) for t in _flatten(v, f"{prefix}.{i}")]
    return []


def selected(name: str, patterns) -> bool:
    """``modules`` filter: a glob (``model.layers.*.mlp*``) or a prefix (``model.layers.3``)."""
    if not patterns:
        return True
    return any(fnmatch.fnmatchcase(name, p) or name == p or name.startswith(p + ".") for p in patterns)


class Tap:
    """Records module calls and portarl's ops for one forward + backward."""

    def __init__(self, out: Path, budget_bytes: int, patterns=None):
        self.writer = ShardWriter(out, budget_bytes)
        self.patterns = patterns
        self.entries: list[dict] = []
        self.calls: dict[tuple[str, str], int] = {}
        self.param_grads: list[tuple[dict, torch.nn.Module]] = []

    def _infos(self, tag: str, tensors: list[tuple[str, torch.Tensor]]) -> list[dict]:
        out = []
        for i, (_, t) in enumerate(tensors):
            info = summarise(t)
            info["tensor"] = self.writer.offer(f"{tag}.{i}", t)
            out.append(info)
        return out

    def _entry(self, name: str, cls: str, direction: str, inputs, outputs, params=None) -> dict:
        call = self.calls.get((name, direction), 0)
        self.calls[(name, direction)] = call + 1
        tag = f"{len(self.entries)}.{name}.{direction}.{call}"
        entry = {"name": name, "class": cls, "direction": direction, "call": call, "order": len(self.entries),
                 "input_names": [n for n, _ in inputs], "inputs": self._infos(f"{tag}.in", inputs),
                 "outputs": self._infos(f"{tag}.out", outputs), "params": {}}
        for pname, p in (params or {}).items():
            info = summarise(p)
            info["tensor"] = self.writer.offer(f"{tag}.param.{pname}", p)
            entry["params"][pname] = info
        self.entries.append(entry)
        return entry

    # ---- module hooks ----
    def attach(self, model: torch.nn.Module) -> list:
        handles = []
        for name, module in model.named_modules():
            if not name or not selected(name, self.patterns):
                continue
            handles.append(module.register_forward_hook(self._forward_hook(name), with_kwargs=True))
            handles.append(module.register_full_backward_hook(self._backward_hook(name)))
        return handles

    def _forward_hook(self, name: str):
        def hook(module, args, kwargs, output):
            inputs = _flatten(tuple(args), "arg") + [(f"kw:{k.lstrip('.')}", t) for k, t in _flatten(kwargs, "")]
            params = dict(module.named_parameters(recurse=False))
            self._entry(name, type(module).__name__, "forward", inputs, _flatten(output, "out"),
                        {k: p.detach() for k, p in params.items()})
        return hook

    def _backward_hook(self, name: str):
        def hook(module, grad_input, grad_output):
            entry = self._entry(name, type(module).__name__, "backward",
                                [(f"grad_out.{i}", g) for i, g in enumerate(grad_output) if g is not None],
                                [(f"grad_in.{i}", g) for i, g in enumerate(grad_input) if g is not None])
            self.param_grads.append((entry, module))
        return hook

    # ---- portarl's ops ----
    def record(self, name: str, output: torch.Tensor, inputs=()) -> torch.Tensor:
        """Record op ``name`` (e.g. ``portarl.logprobs``): its ``inputs`` and ``output`` now,
        the grad of ``output`` when the backward reaches it. Returns ``output`` unchanged."""
        if not selected(name, self.patterns):
            return output
        cls = "PortarlOp"
        self._entry(name, cls, "forward", [(f"arg.{i}", t) for i, t in enumerate(inputs) if t is not None],
                    [("out", output)])
        if output.requires_grad:
            def grad_hook(grad):
                self._entry(name, cls, "backward", [("grad_out.0", grad)], [])
            output.register_hook(grad_hook)
        return output

    def finish_param_grads(self) -> None:
        """Each backward entry gets its module's parameter grads (final once backward ends).
        A parameter shared by several modules (tied embeddings) holds the sum of their
        grads: it goes to the module whose backward ran last, once the sum was complete."""
        seen: set[int] = set()
        for entry, module in reversed(self.param_grads):
            for pname, p in module.named_parameters(recurse=False):
                if p.grad is not None and id(p) not in seen and pname not in entry["params"]:
                    seen.add(id(p))
                    info = summarise(p.grad)
                    info["tensor"] = self.writer.offer(f"{entry['order']}.{entry['name']}.grad.{pname}", p.grad)
                    entry["params"][pname] = info


def default_step(model, batch, tap: Tap) -> torch.Tensor:
    """The model called on ``batch`` (a dict of keyword arguments, or one input) and its
    ``.loss`` (a Hugging Face model given ``labels``)."""
    out = model(**batch) if isinstance(batch, dict) else model(batch)
    loss = getattr(out, "loss", None)
    if loss is None:
        raise ValueError("dump_modules: the model returned no .loss; pass labels in the batch or a step_fn "
                         "(model, batch, tap) -> loss")
    logits = getattr(out, "logits", None)
    return tap.record("loss", loss, inputs=() if logits is None else (logits,))


def dump_modules(model: torch.nn.Module, batch, out: str | Path, *,
                 step_fn: Callable | None = None, modules=None, budget_mb: float = 1024.0, step: int = 0,
                 rank: int = 0, environment: dict | None = None, extra: dict | None = None) -> Path:
    """Run ``step_fn(model, batch, tap) -> loss`` (default :func:`default_step`) and
    ``loss.backward()`` with every module of ``model`` hooked (or those ``modules``
    matches: globs or prefixes), and write the dump to ``out`` (replaced if it is a dump).

    ``budget_mb`` bounds the full tensors kept (call order); every tensor is summarised.
    ``environment`` (default: :func:`portarl.backends.envinfo.environment` of the model's device)
    and ``extra`` (e.g. the dtype and emulation switches) go into the index. Gradients are
    left on the parameters (the caller zeroes them). Returns the index path."""
    from portarl.backends import envinfo

    out = Path(out)
    if out.exists() and (out / "index.json").exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    tap = Tap(out, int(budget_mb * (1 << 20)), list(modules) if modules else None)
    device = next(model.parameters()).device
    handles = tap.attach(model)
    try:
        with warnings.catch_warnings():
            # Full backward hooks warn on modules whose output is a ModelOutput (the decoder
            # itself; its children are recorded) and on those with no input needing grad.
            warnings.filterwarnings("ignore", message=".*(backward hook|Full backward hook).*")
            loss = (step_fn or default_step)(model, batch, tap)
            loss.float().backward()
        tap.finish_param_grads()
    finally:
        for h in handles:
            h.remove()
        tap.writer.flush()
    index = {"format": FORMAT, "step": step, "rank": rank,
             "environment": environment if environment is not None else envinfo.environment(device),
             "param_dtype": str(next(model.parameters()).dtype), "budget_mb": budget_mb,
             "modules": list(modules) if modules else None, "shards": tap.writer.shards,
             **(extra or {}), "entries": tap.entries}
    return write_index(out, index)
