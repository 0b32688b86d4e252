"""Parity reports: write and read JSON, print tables, compare two devices.

A report is one sweep on one device. ``compare_reports`` lines two reports up by
(op, case, dtype, quantity) for each report's primary backend (the device's own) and
fails a row when either side failed its float64 check, when either side is missing the
case, or when the saved output samples differ between the devices by more than the
case's tolerance.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from pathlib import Path
from typing import Iterable

import torch

from portarl.parity.record import Record
from portarl.parity.sweep import native_backend, report_label

SCHEMA = "portarl.parity/1"


def _jsonable(value):
    """JSON has no nan/inf: write them as the strings "nan", "inf", "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def _number(value):
    return float(value) if isinstance(value, str) else value


def build_report(device: torch.device, records: list[Record], environment: dict) -> dict:
    return {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "primary_backend": native_backend(device),
        "environment": environment,
        "passed": all(r.passed for r in records),
        "results": [_jsonable(dataclasses.asdict(r)) for r in records],
    }


def write_report(report: dict, path: str | Path) -> Path:
    """Write atomically (temp file then rename): a crash never leaves half a report."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
    tmp.replace(path)
    return path


def read_report(path: str | Path) -> dict:
    path = Path(path)
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"parity report {path} does not exist; write one with `portarl parity --out {path}`") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not a parity report (invalid JSON: {err})") from None
    if not isinstance(report, dict) or report.get("schema") != SCHEMA:
        raise ValueError(f"{path} is not a {SCHEMA} parity report (schema={report.get('schema') if isinstance(report, dict) else None!r})")
    return report


def records_of(report: dict) -> list[Record]:
    fields = {f.name for f in dataclasses.fields(Record)}
    numeric = {"max_abs", "max_rel", "worst_ratio", "atol", "rtol", "forward_ms", "backward_ms"}
    return [
        Record(**{k: (_number(v) if k in numeric else v) for k, v in r.items() if k in fields})
        for r in report["results"]
    ]


def _fmt(x: float | None, spec: str = ".2e") -> str:
    return "-" if x is None else format(x, spec)


def format_table(records: Iterable[Record]) -> str:
    """One line per (backend, dtype, op, case, quantity): error, tolerance use, time, status."""
    header = f"{'backend':<9} {'dtype':<5} {'op':<8} {'case':<26} {'qty':<9} {'max_abs':>9} {'max_rel':>9} {'of_tol':>7} {'fwd_ms':>8} {'bwd_ms':>8}  status"
    lines = [header, "-" * len(header)]
    for r in records:
        status = "pass" if r.passed else ("ERROR " + (r.error or "")[:60] if r.error else "FAIL")
        lines.append(
            f"{r.backend:<9} {r.dtype:<5} {r.op:<8} {r.case:<26} {r.quantity:<9} {_fmt(r.max_abs):>9} "
            f"{_fmt(r.max_rel):>9} {_fmt(r.worst_ratio, '.2f'):>7} {_fmt(r.forward_ms, '.2f'):>8} "
            f"{_fmt(r.backward_ms, '.2f'):>8}  {status}"
        )
    return "\n".join(lines)


def summary(records: list[Record]) -> str:
    """Per backend x dtype x op: checks, worst use of the tolerance; then the total."""
    groups: dict[tuple[str, str, str], list[Record]] = {}
    for r in records:
        groups.setdefault((r.backend, r.dtype, r.op), []).append(r)
    lines = [f"{'backend':<9} {'dtype':<5} {'op':<8} {'checks':>6} {'failed':>6} {'worst_of_tol':>12}"]
    for (backend, dtype, op), rs in groups.items():
        ratios = [r.worst_ratio for r in rs if r.worst_ratio is not None]
        lines.append(
            f"{backend:<9} {dtype:<5} {op:<8} {len(rs):>6} {sum(not r.passed for r in rs):>6} "
            f"{_fmt(max(ratios) if ratios else None, '.2f'):>12}"
        )
    failed = [r for r in records if not r.passed]
    lines.append(f"{len(records) - len(failed)}/{len(records)} checks within tolerance" + (
        f"; {len(failed)} FAILED" if failed else ""
    ))
    return "\n".join(lines)


@dataclasses.dataclass
class Comparison:
    key: tuple[str, str, str, str]
    a: Record | None
    b: Record | None
    max_device_diff: float | None
    problems: list[str]

    @property
    def passed(self) -> bool:
        return not self.problems


def _as_float(v: float | str) -> float:
    return float(v)  # "nan" / "inf" / "-inf" strings parse


def _device_diff(a: Record, b: Record) -> tuple[float, bool]:
    """Largest |a - b| over the shared sample positions and whether all are within tolerance."""
    if a.sample_index != b.sample_index:
        raise ValueError(f"{a.key}: the reports sampled different positions (different portarl versions?)")
    atol = max(a.atol or 0.0, b.atol or 0.0)
    rtol = max(a.rtol or 0.0, b.rtol or 0.0)
    worst, ok = 0.0, True
    for va, vb in zip(map(_as_float, a.sample_values), map(_as_float, b.sample_values)):
        if math.isnan(va) or math.isnan(vb) or math.isinf(va) or math.isinf(vb):
            if not (va == vb or (math.isnan(va) and math.isnan(vb))):
                ok, worst = False, math.inf
            continue
        diff = abs(va - vb)
        worst = max(worst, diff)
        if diff > atol + rtol * max(abs(va), abs(vb)):
            ok = False
    return worst, ok


def compare_reports(a: dict, b: dict, backend_a: str | None = None, backend_b: str | None = None) -> list[Comparison]:
    """``backend_a`` / ``backend_b``: a backend name (``cuda`` in a CPU report means its
    ``cuda-interpreted`` rows) or a row label; default each report's primary backend."""
    ba = report_label(backend_a, a["device"]) if backend_a else a["primary_backend"]
    bb = report_label(backend_b, b["device"]) if backend_b else b["primary_backend"]
    ra = {r.key: r for r in records_of(a) if r.backend == ba}
    rb = {r.key: r for r in records_of(b) if r.backend == bb}
    if not ra:
        raise ValueError(f"report A ({a['device']}) has no results for backend {ba!r}")
    if not rb:
        raise ValueError(f"report B ({b['device']}) has no results for backend {bb!r}")
    out = []
    for key in sorted(set(ra) | set(rb)):
        x, y = ra.get(key), rb.get(key)
        problems = []
        diff = None
        if x is None or y is None:
            problems.append(f"missing in report {'A' if x is None else 'B'}")
        else:
            for side, r in (("A", x), ("B", y)):
                if not r.passed:
                    problems.append(f"{side} exceeds tolerance" if r.error is None else f"{side} error: {r.error}")
            if x.error is None and y.error is None:
                diff, ok = _device_diff(x, y)
                if not ok:
                    problems.append("devices differ by more than the tolerance")
        out.append(Comparison(key, x, y, diff, problems))
    return out


def _applied_tolerance(a: Record | None, b: Record | None) -> tuple[float | None, float | None]:
    """(atol, rtol) as :func:`_device_diff` applies them: the larger of the two reports'."""
    present = [r for r in (a, b) if r is not None]
    if not present:
        return None, None
    atol = [r.atol for r in present if r.atol is not None]
    rtol = [r.rtol for r in present if r.rtol is not None]
    return (max(atol) if atol else None), (max(rtol) if rtol else None)


def format_comparison(rows: list[Comparison], a: dict, b: dict) -> str:
    name_a = f"A: {a['device']} ({a['environment'].get('device_name')}, backend {rows[0].a.backend if rows and rows[0].a else '?'})"
    name_b = f"B: {b['device']} ({b['environment'].get('device_name')}, backend {rows[0].b.backend if rows and rows[0].b else '?'})"
    # The full tolerance applied to A-B: |a - b| <= atol + rtol * max(|a|, |b|), with each the
    # larger of the two reports' values (see _device_diff). atol alone made rows read as
    # contradictory (A-B above "tol" yet passing through the rtol term).
    header = (f"{'dtype':<5} {'op':<8} {'case':<26} {'qty':<9} {'A_err':>9} {'B_err':>9} {'A-B':>9} "
              f"{'atol':>9} {'rtol':>9}  status")
    legend = "A-B passes when |a - b| <= atol + rtol * max(|a|, |b|) at every sampled position"
    lines = [name_a, name_b, legend, header, "-" * len(header)]
    for c in rows:
        op, case, dtype, qty = c.key
        atol, rtol = _applied_tolerance(c.a, c.b)
        lines.append(
            f"{dtype:<5} {op:<8} {case:<26} {qty:<9} {_fmt(c.a.max_abs if c.a else None):>9} "
            f"{_fmt(c.b.max_abs if c.b else None):>9} {_fmt(c.max_device_diff):>9} {_fmt(atol):>9} {_fmt(rtol):>9}  "
            + ("pass" if c.passed else "FAIL: " + "; ".join(c.problems))
        )
    failed = sum(not c.passed for c in rows)
    lines.append(f"{len(rows) - failed}/{len(rows)} cases agree" + (f"; {failed} FAILED" if failed else ""))
    return "\n".join(lines)
