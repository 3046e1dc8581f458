"""Experiment trackers: real one-process runs logging to W&B (offline) and MLflow (a file
store), each leaving the run's metrics, its config and its final summary there.

Each test needs its extra (`pip install -e ".[wandb]"`, `".[mlflow]"`) and is skipped
without it."""

from __future__ import annotations

import json
import struct
import sys

import pytest

from .conftest import RECIPES, read_summary, run_command, tiny_overrides

RECIPE = RECIPES[0]
pytestmark = pytest.mark.slow


def train(run_dir, logger: str) -> dict:
    command = [
        sys.executable,
        "train.py",
        *tiny_overrides(RECIPE),
        f"loggers=[csv,{logger}]",
        "experiment=tracked",
        f"run_dir={run_dir}",
    ]
    return read_summary(run_command(command))


def test_wandb_offline_run_holds_metrics_config_and_summary(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="needs the [wandb] extra")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    summary = train(run_dir, "wandb")
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    (log,) = offline.glob("run-*.wandb")  # what `wandb sync` uploads
    config, history, summaries = {}, [], {}
    for record in wandb_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            items = record.history.item
            history.append({"/".join(item.nested_key): json.loads(item.value_json) for item in items})
        elif kind == "summary":
            summaries.update({item.key: json.loads(item.value_json) for item in record.summary.update})
    assert config["recipe"] == RECIPE and config["total_frames"] == 3072
    steps = [row["trainer/global_step"] for row in history if "frames_per_s" in row]
    assert steps == [1024, 2048, 3072]
    assert summaries["frames_collected"] == summary["frames_collected"] == 3072
    assert summaries["eval_return"] == pytest.approx(summary["eval_return"])


def wandb_records(path) -> list:
    """The records of a W&B run file: a 7-byte header, then LevelDB's log format (32 KiB
    blocks of chunks with a 7-byte header: crc, length, type) around protobuf records. No
    public reader exists for offline runs; should the format change, this fails loudly."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    position, block, records, pending = 7, 32768, [], b""
    while position + 7 <= len(data):
        room = block - position % block
        _, length, chunk_type = struct.unpack("<IHB", data[position : position + 7])
        if room < 7 or (length == 0 and chunk_type == 0):  # block padding
            position += room
            continue
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if chunk_type in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_mlflow_file_store_run_holds_metrics_config_and_summary(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="needs the [mlflow] extra")
    from mlflow.tracking import MlflowClient

    store = f"file:{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    # MLflow 3 keeps the file store for those who opt in; it suits a test (no database).
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    summary = train(tmp_path / "run", "mlflow")
    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("tracked").experiment_id])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert run.data.params["recipe"] == RECIPE and run.data.params["total_frames"] == "3072"
    history = client.get_metric_history(run.info.run_id, "frames_per_s")
    assert [metric.step for metric in history] == [1024, 2048, 3072]
    assert run.data.metrics["eval_return"] == pytest.approx(summary["eval_return"])
    artifacts = {artifact.path for artifact in client.list_artifacts(run.info.run_id)}
    assert {"summary.json", "learning_curve.png", "config.yaml"} <= artifacts
