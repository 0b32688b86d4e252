"""The ``locate`` report: ``locate.md`` (verdict, table), ``locate.json`` (every row) and
``locate.png`` (output error by module call, against what rounding and propagation explain)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from portarl.bench.stability.report import _pyplot


def _g(v, spec: str = ".2e") -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    return format(v, spec)


def plot_errors(result: dict, path: Path) -> Path | None:
    plt = _pyplot()
    if plt is None or not result["rows"]:
        return None
    fig, axes = plt.subplots(2, 1, figsize=(14, 7))
    for ax, direction in zip(axes, ("forward", "backward")):
        rows = [r for r in result["rows"] if r["direction"] == direction and r["judged"]]
        if not rows:
            ax.set_visible(False)
            continue
        xs = list(range(len(rows)))
        floor = 1e-10  # bit-equal outputs sit here

        def clip(v):
            return min(max(v, floor), 1e6) if v == v else 1e6

        ax.plot(xs, [clip(r["out_err"]) for r in rows], ".-", label="output rel. error (L2)", linewidth=1)
        ax.plot(xs, [clip(r["in_err"]) for r in rows], ".", alpha=0.5, label="input rel. error")
        ax.plot(xs, [clip(r["expected"]) for r in rows], "k--", linewidth=0.8, label="explained by propagation + rounding")
        flagged = [(i, r) for i, r in enumerate(rows) if r["verdict"] != "-"]
        if flagged:
            ax.scatter([i for i, _ in flagged], [clip(r["out_err"]) for _, r in flagged], color="red", zorder=3,
                       label="culprit / amplifies")
            i, r = flagged[0]
            ax.annotate(r["module"], (i, clip(r["out_err"])), fontsize=8, color="red")
        ticks = [i for i, r in enumerate(rows) if r["module"].count(".") <= 2]
        ax.set_xticks(ticks)
        ax.set_xticklabels([rows[i]["module"] for i in ticks], rotation=60, fontsize=6, ha="right")
        ax.set_yscale("log")
        ax.set_title(f"{direction}: relative error per module call ({'call order' if direction == 'forward' else 'autograd order'})")
        ax.legend(fontsize=7)
    fig.suptitle(result["verdict"], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_locate_report(result: dict, out: str | Path) -> Path:
    """Write ``locate.md``, ``locate.json`` and ``locate.png`` into ``out``; returns the .md."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "locate.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    figure = plot_errors(result, out / "locate.png")
    s = result["settings"]
    lines = ["# portarl locate", "", f"**{result['verdict']}**", "",
             f"A: `{result['a']}` ({s['a'].get('label') or s['a'].get('param_dtype')}); "
             f"B: `{result['b']}` ({s['b'].get('label') or s['b'].get('param_dtype')}).",
             "", "Modules paired by name and call; walked in A's call order, forward then backward. "
             f"Explained error = {result['tolerance']['propagation']:g} x input error + "
             f"{result['tolerance']['rounding']:g} x the unit roundoff of the coarsest dtype involved. "
             "culprit: bit-equal inputs, different outputs; amplifies: output error beyond what is explained."]
    if any((s[k].get("emulation") or []) for k in ("a", "b")):
        lines += ["", "A side with emulation switches ran portarl.backends.emulation (EMULATION of an Ascend stack's "
                  "documented numerics), not Ascend hardware."]
    if figure is not None:
        lines += ["", f"![error by module]({figure.name})"]
    for direction in ("forward", "backward"):
        rows = [r for r in result["rows"] if r["direction"] == direction]
        lines += ["", f"## {direction}", "",
                  "| # | module | in err | out err | max rel | mean rel | cosine | amplification | explained | verdict |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            name = r["module"] + (f" (call {r['call']})" if r["call"] else "")
            lines.append(f"| {r['order']} | {name} | {'bit-equal' if r['in_exact'] else _g(r['in_err'])} | "
                         f"{'bit-equal' if r['out_exact'] else _g(r['out_err'])} | {_g(r['max_rel'])} | "
                         f"{_g(r['mean_rel'])} | {_g(r['cos'], '.6f')} | {_g(r['amplification'], '.3g')} | "
                         f"{_g(r['expected'])} | {r['verdict'] if r['judged'] else 'n/a (' + r['unjudged'] + ')'} |")
    for side in ("a", "b"):
        only = result[f"only_in_{side}"]
        if only:
            lines += ["", f"Only in {side.upper()} ({len(only)}): " + ", ".join(only[:40])
                      + (" ..." if len(only) > 40 else "")]
    env = result["environment"]
    lines += ["", "## Environment", "", "| side | device | torch | torch_npu | CANN |", "|---|---|---|---|---|"]
    for side in ("a", "b"):
        e = env[side] or {}
        lines.append(f"| {side.upper()} | {e.get('device_name', '-')} | {e.get('torch', '-')} | "
                     f"{e.get('torch_npu') or '-'} | {e.get('cann') or '-'} |")
    path = out / "locate.md"
    path.write_text("\n".join(lines) + "\n")
    return path
