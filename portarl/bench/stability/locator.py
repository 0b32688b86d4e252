"""Where two dumps of the same step part: ``locate(a, b)``, module by module.

Pairing: by module path, direction and that module's own call number (``model.layers.7.mlp
.down_proj``, forward, call 0), never by a global op counter, which shifts as soon as two
machines run different kernels. The walk is in ``a``'s call order, forward then backward.

Per module call, over float64 copies of the full tensors (summaries where the size budget
left a tensor out):

- ``in_err``: the largest relative L2 difference ``||a - b|| / max(||a||, ||b||)`` over
  what the call computes from: forward, its inputs and its (and its submodules')
  parameters; backward, the grads of its outputs plus the forward call's inputs and
  parameters (autograd reuses them); for a container (a decoder layer, the model), also
  its submodules' outputs in the same call. Bit-equal (same dtype, shape and CRC-32)
  everywhere means ``in_err = 0``. An op recorded without inputs is listed, not judged.
- ``out_err``: the same over its outputs (backward: grads of its inputs and of its
  parameters); also max and mean relative error (``max|a-b| / max|a|``, ``mean|a-b| /
  mean|a|``) and the cosine similarity. A NaN/inf on one side and not the other is an
  infinite error.
- ``expected = PROPAGATION * in_err + ROUNDING * u``: a module passes its input's relative
  error on, grown by at most ``PROPAGATION`` (a well-conditioned layer: a residual add, a
  linear map with a moderate condition number, a norm), plus its own rounding: ``u`` is
  the unit roundoff (2^-24 fp32, 2^-8 bf16, 2^-11 fp16) of the coarsest dtype among its
  inputs, parameters and outputs on either side, and ``ROUNDING`` roundings of it (a
  module is a few roundings deep: a matmul's output, a norm's scale, an activation).
- ``amplification = out_err / in_err``.

Verdicts: a call with bit-equal inputs and outputs that are not bit-equal is a
**culprit** outright (its numbers differ on the same input: a different kernel, a lower
precision, a fault). Otherwise the first call with ``out_err > expected`` **amplifies**:
it makes more of its input's difference than propagation and its dtype's rounding explain.
A layer that only carries the previous layer's difference on stays under ``expected``.
Where the size budget left a tensor out, only its summary is compared: the CRC-32 still
says bit-equal or not (so a culprit is still named), the gap in L2 norms is a lower bound
of its error, and no "amplifies" verdict is given on such a call.
**First non-finite**: the first call (walk order) whose outputs hold NaN/inf on a side
where all its inputs were finite.
"""

from __future__ import annotations

import math

import torch

from portarl.bench.stability.dump_index import Dump

UNIT_ROUNDOFF = {"torch.float64": 2.0 ** -53, "torch.float32": 2.0 ** -24, "torch.bfloat16": 2.0 ** -8,
                 "torch.float16": 2.0 ** -11}
PROPAGATION = 4.0
ROUNDING = 8.0
_TINY = 1e-300
_CACHE: dict = {}  # cleared by locate()


def _key(e: dict) -> tuple:
    return e["name"], e["direction"], e["call"]


def _bit_equal(ia: dict, ib: dict) -> bool:
    return ia["dtype"] == ib["dtype"] and ia["shape"] == ib["shape"] and ia["crc32"] == ib["crc32"]


def _pair_error(da: Dump, ia: dict, db: Dump, ib: dict) -> dict:
    """Relative L2 / max / mean error and cosine between two summarised tensors (cached:
    a weight is an input of its module and of every module above it)."""
    key = (id(da), id(db), ia["crc32"], ib["crc32"], ia.get("tensor"), ib.get("tensor"))
    if key not in _CACHE:
        _CACHE[key] = _compute_pair_error(da, ia, db, ib)
    return _CACHE[key]


def _compute_pair_error(da: Dump, ia: dict, db: Dump, ib: dict) -> dict:
    if _bit_equal(ia, ib):
        return {"rel": 0.0, "max_rel": 0.0, "mean_rel": 0.0, "cos": 1.0, "exact": True}
    bad_a, bad_b = ia["nan"] + ia["inf"], ib["nan"] + ib["inf"]
    ta, tb = da.tensor(ia), db.tensor(ib)
    if ta is None or tb is None or ta.shape != tb.shape:
        na, nb = ia["norm"] or 0.0, ib["norm"] or 0.0  # summaries only: the gap in norms (a lower bound)
        rel = math.inf if bad_a != bad_b else abs(na - nb) / max(na, nb, _TINY)
        return {"rel": rel, "max_rel": None, "mean_rel": None, "cos": None, "exact": False, "stats_only": True}
    a, b = ta.double().reshape(-1), tb.double().reshape(-1)
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    if not torch.equal(fa, fb) or not torch.equal(a[~fa].nan_to_num(), b[~fb].nan_to_num()):
        return {"rel": math.inf, "max_rel": math.inf, "mean_rel": math.inf, "cos": float("nan"), "exact": False}
    a, b = a[fa], b[fb]
    d = (a - b).abs()
    if not d.numel():
        return {"rel": 0.0, "max_rel": 0.0, "mean_rel": 0.0, "cos": 1.0, "exact": False}
    na, nb = float(a.norm()), float(b.norm())
    cos = float(a @ b) / (na * nb) if na > 0 and nb > 0 else (1.0 if na == nb else 0.0)
    return {"rel": float(d.norm()) / max(na, nb, _TINY), "max_rel": float(d.max()) / max(float(a.abs().max()), _TINY),
            "mean_rel": float(d.mean()) / max(float(a.abs().mean()), _TINY), "cos": cos, "exact": False}


def _weights(entries: list[dict]) -> dict[str, dict]:
    """Every module's parameters (first forward call) by full name: what a call computes
    from includes its submodules' weights (a decoder layer's, the whole model's)."""
    out: dict[str, dict] = {}
    for e in entries:
        if e["direction"] == "forward":
            for k, v in e["params"].items():
                out.setdefault(f"{e['name']}.{k}", v)
    return out


def _descendant_outputs(entries: list[dict]) -> dict[tuple, list[tuple[str, dict]]]:
    """Per (module, direction, call): its submodules' outputs in the same call, which a
    container's output is computed from (a decoder layer from its attention and MLP)."""
    keys = {_key(e) for e in entries}
    out: dict[tuple, list] = {}
    for e in entries:
        parts = e["name"].split(".")
        for n in range(1, len(parts)):
            anc = (".".join(parts[:n]), e["direction"], e["call"])
            if anc in keys:
                out.setdefault(anc, []).extend((f"sub:{e['name']}.{i}", v) for i, v in enumerate(e["outputs"]))
                if e["direction"] == "backward":
                    out[anc].extend((f"sub:{e['name']}.grad:{k}", v) for k, v in e["params"].items())
    return out


def _tensors(entry: dict, role: str, weights: dict[str, dict] | None = None) -> list[tuple[str, dict]]:
    if role == "in":
        prefix = entry["name"] + "."
        own = [(f"param:{k}", v) for k, v in (weights or {}).items() if k.startswith(prefix)]
        return list(zip(entry["input_names"], entry["inputs"])) + own
    outs = [(f"out.{i}", v) for i, v in enumerate(entry["outputs"])]
    return outs + [(f"grad:{k}", v) for k, v in entry["params"].items() if entry["direction"] == "backward"]


def _errors(da, ea_list, db, eb_list) -> tuple[list[dict], bool]:
    """Per-tensor errors of paired (name, info) lists; whether every pair is bit-equal."""
    errs, exact = [], len(ea_list) == len(eb_list)
    b_by_name = dict(eb_list)
    for name, ia in ea_list:
        ib = b_by_name.get(name)
        if ib is None:
            exact = False
            continue
        e = _pair_error(da, ia, db, ib)
        exact = exact and e["exact"]
        errs.append(e)
    return errs, exact


def _finite(entries_tensors) -> bool:
    return all(i["nan"] + i["inf"] == 0 for _, i in entries_tensors)


def _row(da: Dump, ea: dict, db: Dump, eb: dict, fwd_a: dict | None, fwd_b: dict | None) -> dict:
    wa, wb = da.weights, db.weights
    if ea["direction"] == "forward":
        ins_a, ins_b = _tensors(ea, "in", wa), _tensors(eb, "in", wb)
    else:
        ins_a, ins_b = _tensors(ea, "in"), _tensors(eb, "in")
    if ea["direction"] == "backward" and fwd_a is not None and fwd_b is not None:  # autograd reuses the forward's
        ins_a, ins_b = ins_a + _tensors(fwd_a, "in", wa), ins_b + _tensors(fwd_b, "in", wb)
    no_inputs = not ins_a  # an op recorded without its inputs: nothing to judge it against
    ins_a, ins_b = ins_a + da.subs.get(_key(ea), []), ins_b + db.subs.get(_key(eb), [])
    outs_a, outs_b = _tensors(ea, "out"), _tensors(eb, "out")
    in_errs, in_exact = _errors(da, ins_a, db, ins_b)
    out_errs, out_exact = _errors(da, outs_a, db, outs_b)
    in_err = max((e["rel"] for e in in_errs), default=0.0)
    out_err = max((e["rel"] for e in out_errs), default=0.0)
    dtypes = [i["dtype"] for _, i in ins_a + ins_b + outs_a + outs_b]
    u = max((UNIT_ROUNDOFF.get(d, 0.0) for d in dtypes), default=0.0)
    expected = PROPAGATION * in_err + ROUNDING * u
    judged = bool(out_errs) and not no_inputs
    stats_only = any(e.get("stats_only") for e in in_errs + out_errs)
    verdict = "-"
    if judged and in_exact and not out_exact:
        verdict = "culprit"
    elif judged and not stats_only and not out_err <= expected:
        verdict = "amplifies"

    def worst(key):
        vals = [e[key] for e in out_errs if e.get(key) is not None]
        return max(vals, default=None) if key != "cos" else min(vals, default=None)

    return {"order": ea["order"], "module": ea["name"], "class": ea["class"], "direction": ea["direction"],
            "call": ea["call"], "in_err": in_err, "in_exact": in_exact, "out_err": out_err, "out_exact": out_exact,
            "max_rel": worst("max_rel"), "mean_rel": worst("mean_rel"), "cos": worst("cos"), "unit_roundoff": u,
            "expected": expected, "amplification": (out_err / in_err if in_err > 0 else (math.inf if out_err > 0 else 1.0)),
            "verdict": verdict, "judged": judged, "stats_only": stats_only,
            "unjudged": None if judged else ("no inputs recorded" if no_inputs else "no outputs"),
            "nonfinite": {"a": not _finite(outs_a) and _finite(ins_a), "b": not _finite(outs_b) and _finite(ins_b)}}


def _describe(row: dict | None) -> str:
    if row is None:
        return "none beyond rounding"
    call = "" if row["call"] == 0 else f", call {row['call']}"
    where = f"{row['module']} ({row['direction']}{call})"
    if row["verdict"] == "culprit":
        return f"{where}, bit-equal inputs, outputs differ by {row['out_err']:.2g} (rel L2)"
    return (f"{where}, {row['amplification']:.3g}x its input's error ({row['in_err']:.2g} -> {row['out_err']:.2g}; "
            f"rounding and propagation explain {row['expected']:.2g})")


def locate(a, b) -> dict:
    """Compare dumps ``a`` and ``b`` (directories or :class:`Dump`); see the module docstring.
    Returns rows (walk order), the first flagged call per direction, the first non-finite
    call, and a one-line ``verdict``."""
    da = a if isinstance(a, Dump) else Dump(a)
    db = b if isinstance(b, Dump) else Dump(b)
    da.weights, db.weights = _weights(da.entries), _weights(db.entries)
    da.subs, db.subs = _descendant_outputs(da.entries), _descendant_outputs(db.entries)
    _CACHE.clear()
    by_b = {_key(e): e for e in db.entries}
    keys_a = {_key(e) for e in da.entries}
    fwd_a = {(e["name"], e["call"]): e for e in da.entries if e["direction"] == "forward"}
    fwd_b = {(e["name"], e["call"]): e for e in db.entries if e["direction"] == "forward"}
    walk = sorted(da.entries, key=lambda e: (e["direction"] != "forward", e["order"]))
    rows = [_row(da, ea, db, by_b[_key(ea)], fwd_a.get((ea["name"], ea["call"])), fwd_b.get((ea["name"], ea["call"])))
            for ea in walk if _key(ea) in by_b]
    first = {d: next((r for r in rows if r["direction"] == d and r["verdict"] != "-"), None)
             for d in ("forward", "backward")}
    nonfinite = next(({**r, "side": "a" if r["nonfinite"]["a"] else "b"} for r in rows
                      if r["nonfinite"]["a"] or r["nonfinite"]["b"]), None)
    lead = first["forward"] or first["backward"]
    verdict = f"first amplification: {_describe(lead)}"
    if first["forward"] and first["backward"]:
        verdict += f"; backward: {_describe(first['backward'])}"
    elif lead is not None and lead["direction"] == "forward":
        verdict += "; backward: none beyond what the forward explains"
    nf = "none" if nonfinite is None else (f"{nonfinite['module']} ({nonfinite['direction']}, "
                                          f"{'A' if nonfinite['side'] == 'a' else 'B'})")
    verdict += f"; first non-finite: {nf}"
    if lead is None and rows:
        top = max(rows, key=lambda r: r["out_err"] / max(r["expected"], _TINY) if r["judged"] else 0.0)
        verdict += (f" (closest: {top['module']} ({top['direction']}), out err {top['out_err']:.2g} "
                    f"= {top['out_err'] / max(top['expected'], _TINY):.2f} of what rounding and propagation explain)")
    return {"a": str(da.dir), "b": str(db.dir), "rows": rows, "first": first, "first_nonfinite": nonfinite,
            "verdict": verdict, "only_in_a": sorted(".".join(map(str, k)) for k in keys_a - set(by_b)),
            "only_in_b": sorted(".".join(map(str, k)) for k in set(by_b) - keys_a),
            "environment": {"a": da.index.get("environment"), "b": db.index.get("environment")},
            "settings": {"a": {k: da.index.get(k) for k in ("label", "param_dtype", "emulation", "step")},
                         "b": {k: db.index.get(k) for k in ("label", "param_dtype", "emulation", "step")}},
            "tolerance": {"propagation": PROPAGATION, "rounding": ROUNDING}}
