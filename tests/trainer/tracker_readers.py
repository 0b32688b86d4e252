"""Read back what each experiment tracker stored, offline, through the tracker's own formats
and clients, as ``{run id: {"steps": {step: {metric: value}}, ...}}`` for the tracker tests
(tests/trainer/test_trackers.py).

- W&B offline: each run folder's ``run-<id>.wandb`` is a LevelDB-style record log (the
  format ``wandb sync`` uploads: a 7-byte ``:W&B`` header, then 32 KiB blocks of records with
  a CRC-32 each) of W&B's ``Record`` protobuf messages (``wandb.proto.wandb_internal_pb2``,
  shipped with wandb). W&B has no public offline reader (``wandb.Api`` needs the server, and
  the Python datastore reader of older versions is gone); this reader checks the header,
  every record's checksum and the block padding, so a changed format fails loudly here
  rather than reading wrong values.
- SwanLab offline / local: the run folder's ``run-<id>.swanlab``, the same log format with a
  ``:SWL`` header, read with SwanLab's own reader (``DataStoreReader``) and record protobuf.
- MLflow: the run's metric history through ``MlflowClient`` on the same tracking URI.
- Trackio: the project's SQLite database through Trackio's own ``SQLiteStorage``.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

BLOCK, HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def log_records(path: Path, ident: bytes, magic: int):
    """The records of a LevelDB-style log file written by W&B (``ident`` ``b":W&B"``)."""
    data = Path(path).read_bytes()
    head = struct.unpack("<4sHB", data[:HEADER])
    assert head[:2] == (ident, magic), f"{path}: not a {ident!r} log (header {head})"
    pos, pending = HEADER, None
    while pos < len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # the end of a block too short for a record header: zero padding
            assert data[pos:pos + left] == b"\0" * left, f"{path}: bad block padding at {pos}"
            pos += left
            continue
        if pos + HEADER > len(data):
            break
        checksum, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0 and checksum == 0:  # zero-filled rest of the last block
            break
        chunk = data[pos + HEADER: pos + HEADER + length]
        assert len(chunk) == length, f"{path}: record at {pos} cut short"
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == checksum, f"{path}: bad checksum at {pos}"
        pos += HEADER + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
            pending = None
        else:
            raise AssertionError(f"{path}: unknown record type {kind} at {pos}")


def wandb_runs(root: Path) -> dict:
    """Every offline run folder under ``root``/wandb, merged by run id: its steps (in the
    order of the folders, as ``wandb sync`` would lay them), project, name, tags, config
    and the folders."""
    from wandb.proto import wandb_internal_pb2 as pb

    runs: dict = {}
    for folder in sorted(Path(root, "wandb").glob("offline-run-*")):
        for path in folder.glob("run-*.wandb"):
            run = None  # each file opens with its run record
            for raw in log_records(path, b":W&B", 0xBEE1):
                record = pb.Record()
                record.ParseFromString(raw)
                kind = record.WhichOneof("record_type")
                if kind == "run":
                    run = runs.setdefault(record.run.run_id, {"steps": {}, "folders": [], "config": {}, "media": {}})
                    run["folders"].append(folder)
                    run.update(project=record.run.project, tags=list(record.run.tags))
                    if record.run.display_name:
                        run["name"] = record.run.display_name
                    run["config"].update({u.key: json.loads(u.value_json) for u in record.run.config.update})
                elif kind == "config":
                    run["config"].update({u.key: json.loads(u.value_json) for u in record.config.update})
                elif kind == "history":
                    step, media = record.history.step.num, {}
                    for item in record.history.item:
                        value = json.loads(item.value_json)
                        if len(item.nested_key) > 1:  # a table or an image: its file's description, field by field
                            media.setdefault(item.nested_key[0], {})[item.nested_key[1]] = value
                        elif not (key := item.key or item.nested_key[0]).startswith("_"):
                            run["steps"].setdefault(step, {})[key] = value
                    for key, fields in media.items():
                        run["media"].setdefault(key, []).append((step, fields))
    return runs


def swanlab_runs(log_dir: Path) -> dict:
    """Every run folder under ``log_dir`` (SwanLab's offline or local mode), merged by run id:
    its scalar steps, name, project, the media keys logged and the folders."""
    from swanlab.proto.swanlab.record.v1 import record_pb2
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    runs: dict = {}
    for folder in sorted(Path(log_dir).glob("run-*")):
        for path in folder.glob("run-*.swanlab"):
            reader = DataStoreReader()
            reader.open(path)
            try:
                for raw in reader:
                    record = record_pb2.Record()
                    record.ParseFromString(raw)
                    kind = record.WhichOneof("record_type")
                    if kind == "start":
                        run = runs.setdefault(record.start.id, {"steps": {}, "folders": [], "media": {}})
                        run["folders"].append(folder)
                        run.update(project=record.start.project, tags=list(record.start.tags))
                        run.setdefault("name", record.start.name)
                    elif kind == "scalar" and not record.scalar.key.startswith("__swanlab__"):  # not its system metrics
                        run["steps"].setdefault(record.scalar.step, {})[record.scalar.key] = record.scalar.value.number
                    elif kind == "media":  # a text list (the samples) or an image, at its step
                        run["media"].setdefault(record.media.key, []).append(record.media.step)
            finally:
                reader.close()
    return runs


def mlflow_run(uri: str, run_id: str) -> dict:
    """The run's metric history by step, its parameters, tags, status and artifacts."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    run = client.get_run(run_id)
    steps: dict = {}
    for key in run.data.metrics:
        for point in client.get_metric_history(run_id, key):
            steps.setdefault(point.step, {})[key] = point.value
    artifacts = [a.path for a in client.list_artifacts(run_id)]
    for folder in [a for a in artifacts if "." not in a.rsplit("/", 1)[-1]]:
        artifacts += [a.path for a in client.list_artifacts(run_id, folder)]
    return {"steps": steps, "params": run.data.params, "tags": run.data.tags, "status": run.info.status,
            "name": run.info.run_name, "experiment": client.get_experiment(run.info.experiment_id).name,
            "artifacts": artifacts}


def trackio_runs(project: str) -> dict:
    """Every run of a Trackio project (``$TRACKIO_DIR`` of this process): its steps and config."""
    from trackio.sqlite_storage import SQLiteStorage

    runs = {}
    for name in SQLiteStorage.get_runs(project):
        steps, media = {}, {}
        logs = SQLiteStorage.get_logs(project, name)
        for row in logs:
            step = row["step"]
            for key, value in row.items():
                if key in ("step", "timestamp", "run", "project") or key.startswith("system/"):
                    continue
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    steps.setdefault(step, {})[key] = value
                elif value is not None:
                    media.setdefault(key, []).append(step)
        runs[name] = {"steps": steps, "media": media, "config": SQLiteStorage.get_run_config(project, name) or {},
                      # the step of every row holding the step's metrics, in order: a step logged twice shows
                      "metric_rows": [row["step"] for row in logs if "reward/mean" in row]}
    return runs
