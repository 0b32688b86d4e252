"""The weight-sync benchmark end to end on the tiny model: one receiver process, file and
collective paths, the report's bytes per step and the 7B / 70B estimate."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from portarl.bench.weight_sync import estimate, run_case, write_report  # noqa: E402


def test_tiny_case_reports_both_paths_with_the_models_bytes(tmp_path):
    from portarl.assets.models import build_tiny

    case = run_case("tiny", "bf16", 1, reps=2, buckets_mb=[0.01, 64], work=tmp_path)
    model = build_tiny()[0]
    untied = {id(p): p for p in model.parameters()}.values()
    payload = sum(p.numel() for p in untied) * 2  # bf16, the tied head once
    summary = case["summary"]
    assert set(summary) == {"file", "collective-0.01", "collective-64"}
    assert summary["collective-64"]["bytes"] == summary["collective-0.01"]["bytes"] == payload
    assert payload < summary["file"]["bytes"] < payload + 64 * 1024  # plus the safetensors header
    assert summary["collective-0.01"]["buckets"] > summary["collective-64"]["buckets"] == 1
    for method in summary.values():
        assert method["total_s"]["min"] > 0 and len(case["runs"]["file"]) == 2
    result = {"command": "test", "machine": "test", "load_before": (0, 0, 0), "load_after": (0, 0, 0),
              "uptime_after": "", "cases": [case], "estimate": estimate()}
    write_report(result, tmp_path / "out")
    text = (tmp_path / "out" / "weight-sync-cpu.md").read_text()
    assert "collective, 64 MB buckets" in text and "file (safetensors)" in text and "| 70B | 140 |" in text


def test_estimate_is_bytes_over_bandwidth_plus_bucket_overhead():
    rows = {(r["model"], r["link"]): r for r in estimate(bucket_mb=256)}
    nvlink = next(r for (m, link), r in rows.items() if m == "7B" and link.startswith("NVLink"))
    assert nvlink["bytes"] == 14e9 and nvlink["buckets"] == 53  # ceil(14e9 / 256 MiB)
    assert nvlink["seconds"] == pytest.approx(14e9 / 360e9 + 53 * 5e-4)
    assert torch.tensor([r["seconds"] for r in rows.values()]).gt(0).all()
