"""Experiment trackers: one real one-process run logging to W&B (offline) and MLflow (a
file store) at once, leaving the run's metrics, its config and its final summary in each.

Each tracker needs its extra (`pip install -e ".[wandb]"`, `".[mlflow]"`); its test is
skipped without it."""

from __future__ import annotations

import importlib.util
import json
import struct
import sys

import pytest

from .conftest import RECIPES, learners_run, read_summary, run_command, tiny_overrides

RECIPE = RECIPES[0]
pytestmark = pytest.mark.slow
# Lightning's loggers for them come with either extra.
LIGHTNING = importlib.util.find_spec("pytorch_lightning") is not None
TRACKERS = [name for name in ("wandb", "mlflow") if LIGHTNING and importlib.util.find_spec(name)]


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """The run's folder, its summary and the MLflow store, from one run with every installed
    tracker: each run costs the ranks' start-up, which is most of a tiny run."""
    if not TRACKERS:
        pytest.skip("needs the [wandb] or [mlflow] extra")
    folder = tmp_path_factory.mktemp("tracked")
    store = f"file:{folder / 'mlruns'}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("WANDB_SILENT", "true")
        patch.setenv("MLFLOW_TRACKING_URI", store)
        # MLflow 3 keeps the file store for those who opt in; it suits a test (no database).
        patch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        command = [
            sys.executable,
            "train.py",
            *tiny_overrides(RECIPE),
            f"loggers=[csv,{','.join(TRACKERS)}]",
            "experiment=tracked",
            f"run_dir={folder / 'run'}",
        ]
        summary = read_summary(run_command(command))
    return folder / "run", summary, store


def test_wandb_offline_run_holds_metrics_config_and_summary(tracked):
    pytest.importorskip("wandb", reason="needs the [wandb] extra")
    run_dir, summary, _ = tracked
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


def test_mlflow_file_store_run_holds_metrics_config_and_summary(tracked, monkeypatch):
    pytest.importorskip("mlflow", reason="needs the [mlflow] extra")
    from mlflow.tracking import MlflowClient

    _, summary, store = tracked
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for this process's client too
    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("tracked").experiment_id])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert run.data.params["recipe"] == RECIPE and run.data.params["total_frames"] == "3072"
    history = client.get_metric_history(run.info.run_id, "frames_per_s")
    assert [metric.step for metric in history] == [1024, 2048, 3072]
    assert run.data.metrics["eval_return"] == pytest.approx(summary["eval_return"])
    artifacts = {artifact.path for artifact in client.list_artifacts(run.info.run_id)}
    assert {"summary.json", "learning_curve.png", "config.yaml"} <= artifacts


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    """A SQLite store that does not exist yet (MLflow's recommended local store), the one the
    ranks log to."""
    if "mlflow" not in TRACKERS:
        pytest.skip("needs the [mlflow] extra")
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    return store


def test_mlflow_on_three_learners_starts_from_an_empty_store(tmp_path, mlflow_store):
    """Only rank 0 logs, so only rank 0 opens the store: ranks that each opened it raced to
    create its tables (`duplicate column name: step`) and the run exited 1."""
    from mlflow.tracking import MlflowClient

    overrides = [
        *tiny_overrides(RECIPE),
        "loggers=[csv,mlflow]",
        "experiment=three",
        f"run_dir={tmp_path / 'run'}",
    ]
    summary = read_summary(learners_run(3, *overrides))
    client = MlflowClient(mlflow_store)
    (run,) = client.search_runs([client.get_experiment_by_name("three").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.metrics["eval_return"] == pytest.approx(summary["eval_return"])


def test_a_tracker_that_cannot_reach_its_store_stops_every_rank_in_one_line(tmp_path, monkeypatch):
    if "mlflow" not in TRACKERS:
        pytest.skip("needs the [mlflow] extra")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")  # MLflow 3 refuses it
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    result = learners_run(2, *tiny_overrides(RECIPE), "loggers=[csv,mlflow]", f"run_dir={tmp_path / 'run'}")
    assert result.returncode != 0
    reports = [line for line in result.stderr.splitlines() if "stopping:" in line]
    assert {line.split(" ")[1] for line in reports} == {"0", "1"}, result.stderr[-3000:]
    reason = "rank 0 (learner) failed: loggers: mlflow cannot log (The filesystem tracking backend"
    assert all(reason in line for line in reports), result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
