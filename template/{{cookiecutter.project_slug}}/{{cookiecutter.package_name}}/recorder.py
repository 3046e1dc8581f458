"""The run's records, kept by rank 0: resolved config, metrics, progress, summary.json and
the learning curve.

Learners report to it over RPC (or directly, in a one-process run), each a ``Window`` of
metrics at a time. Metrics reported for the same step by every learner are merged into one
row: rates are summed over learners, everything else is averaged. The row goes to the
loggers (``cfg.loggers``, made here: only rank 0 logs, so only rank 0 opens a tracker's
store) and the progress bar.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any, TextIO

import torch
from lightning_fabric.loggers import CSVLogger, TensorBoardLogger
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from .config import planned_frames
from .distributed import restarts
from .distributed.topology import Topology
from .distributed.watchdog import RankFailure
from .plots import learning_curve

log = logging.getLogger(__name__)
SUMMED = ("frames_per_s",)
# Metrics the progress bar shows: their labels and formats.
PROGRESS = {
    "frames_per_s": ("frames/s", ".0f"),
    "updates_per_s": ("updates/s", ".0f"),
    "train_return": ("return", ".1f"),
    "eval_return": ("eval", ".1f"),
}


class Recorder:
    def __init__(
        self,
        cfg: DictConfig,
        topology: Topology,
        progress_stream: TextIO | None = None,
        resumed: dict[str, Any] | None = None,
    ) -> None:
        """``progress_stream``: where the progress bar goes; by default standard error,
        and only when that is a terminal (logs of batch jobs stay free of it).
        ``resumed``: the meta of the checkpoint the run goes on from."""
        self.topology = topology
        self.title = f"{cfg.recipe} on {cfg.env.id}, seed {cfg.seed}"
        self.collector_mode = cfg.collector.mode
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.resumed_from = str(resumed.folder) if resumed else None
        # The rows logged up to the checkpoint; read before the loggers open, because
        # Fabric's CSV logger deletes the metrics.csv it finds.
        earlier = []
        if resumed:
            earlier = [
                (step, row)
                for step, row in logged_rows(resumed.folder.parent.parent)
                if step <= resumed.frames
            ]
        # A restart of a failed attempt (torchrun --max-restarts): record where it goes on from.
        restarts.start(self.run_dir)
        if restarts.attempt() > 0:
            reached = max((step for step, _ in logged_rows(self.run_dir)), default=0)
            restarts.restarted(self.run_dir, resumed.frames if resumed else 0, reached)
        # Open the metrics files first: Fabric's CSV logger warns about any folder that
        # already holds files when it starts. A resumed run logs the earlier rows again
        # (below), so the warning that they will be deleted does not apply to it.
        with warnings.catch_warnings():
            if resumed:
                warnings.filterwarnings("ignore", message="Experiment logs directory")
            self.loggers = make_loggers(cfg)
        OmegaConf.save(cfg, self.run_dir / "config.yaml")
        for logger in trackers(self.loggers):
            logger.log_hyperparams(OmegaConf.to_container(cfg))
        self.started = time.monotonic()
        if not cfg.progress:
            hidden = True
        elif progress_stream is None:
            hidden = None  # tqdm hides the bar unless standard error is a terminal
        else:
            hidden = False
        self.progress = tqdm(
            initial=resumed.frames if resumed else 0,
            total=planned_frames(cfg, len(topology.learner_ranks), resumed.frames if resumed else 0),
            unit="frame",
            unit_scale=True,
            dynamic_ncols=True,
            file=progress_stream,
            disable=hidden,
        )
        self.latest: dict[str, float] = {}
        self.train_history: list[tuple[int, float]] = []
        self.eval_history: list[dict[str, float]] = []
        self._pending: dict[tuple[int, bool], list[dict[str, float]]] = {}
        self._finished: dict[int, dict[str, Any]] = {}
        self._all_finished = threading.Event()
        self._lock = threading.Lock()
        for step, row in earlier:
            self.record(step, row, wall_s=None)

    def record(self, step: int, row: dict[str, float], wall_s: float | None) -> None:
        """Log a merged row and keep the returns for the summary and the learning curve."""
        if "eval_return" in row:
            self.eval_history.append({"frames": step, "wall_s": wall_s, "eval_return": row["eval_return"]})
        if "train_return" in row:
            self.train_history.append((step, row["train_return"]))
        self.log(row, step)

    def report(self, step: int, metrics: dict[str, float]) -> None:
        """One learner's training or evaluation row at ``step`` (global frames), logged once
        every learner has sent that kind of row for that step. Each row is its own RPC, so one
        learner's evaluation row can arrive before another's training row of the same step:
        rows are paired by kind as well as by step."""
        key = (step, "eval_return" in metrics)
        with self._lock:
            rows = self._pending.setdefault(key, [])
            rows.append(metrics)
            if len(rows) < len(self.topology.learner_ranks):
                return
            del self._pending[key]
            merged = merge(rows)
            self.record(step, merged, wall_s=self.elapsed())
            self.show_progress(step, merged)

    def show_progress(self, frames: int, row: dict[str, float]) -> None:
        self.latest.update(row)
        shown = {
            label: format(self.latest[key], spec)
            for key, (label, spec) in PROGRESS.items()
            if key in self.latest
        }
        self.progress.set_postfix(shown, refresh=False)
        self.progress.update(max(0, frames - self.progress.n))

    def finish(self, rank: int, stats: dict[str, Any]) -> None:
        """A learner's final statistics; the last one releases ``wait_for_learners``."""
        with self._lock:
            self._finished[rank] = stats
            if len(self._finished) == len(self.topology.learner_ranks):
                self._all_finished.set()

    def wait_for_learners(self) -> None:
        self._all_finished.wait()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def close(self, shards: list[dict[str, int]]) -> Path:
        """Write summary.json from the learners' final statistics and close the loggers."""
        learners = [self._finished[rank] for rank in self.topology.learner_ranks]
        eval_returns = [r for stats in learners for r in stats["eval_returns"]]
        frames = learners[0]["frames"]
        updates = learners[0]["updates"]
        train_s = max(stats["train_s"] for stats in learners)
        sampled, inserted = (sum(stats[key] for stats in learners) for key in ("sampled", "inserted"))
        summary = {
            "world_size": self.topology.world_size,
            "roles": self.topology.roles,
            "frames_collected": frames,
            "replay_size": sum(shard["size"] for shard in shards),
            "replay_shard_sizes": [shard["size"] for shard in shards],
            "stale_priority_updates": sum(shard["stale_updates"] for shard in shards),
            # Per shard: the learners that get their sampled frames through shared memory.
            "replay_shared_memory_readers": [shard["shared_memory_readers"] for shard in shards],
            # The signal that stopped the run before total_frames, if one did.
            "resumed_from": self.resumed_from,
            "stopped_by": next((stats["stopped_by"] for stats in learners if stats["stopped_by"]), None),
            "updates": updates,
            "collector_mode": self.collector_mode,
            # Transitions sampled per transition inserted, over the whole run (0 before
            # learning starts), and how many updates old the collector's weights were.
            "samples_per_insert": sampled / inserted if inserted else 0.0,
            "policy_lag": sum(stats["policy_lag"] for stats in learners) / len(learners),
            # Per learner: frames collected in this process, rollouts, how many of them the
            # straggler threshold cut short, and the mean fraction of a full one collected.
            "learner_rollouts": {
                str(rank): self._finished[rank]["rollouts"] for rank in self.topology.learner_ranks
            },
            "learner_param_checksums": {
                str(rank): self._finished[rank]["param_checksum"] for rank in self.topology.learner_ranks
            },
            # null where no final evaluation was played: eval.episodes=0, or a stop by a signal
            "eval_return": sum(eval_returns) / len(eval_returns) if eval_returns else None,
            "eval_episodes": len(eval_returns),
            "eval_history": self.eval_history,
            "frames_per_s": frames / train_s,
            "updates_per_s": updates / train_s,
            "train_s": train_s,
            "wall_s": self.elapsed(),
            "checkpoint": learners[0]["checkpoint"],
            **phases_per_step(learners),
            **restarts.summary(self.run_dir),  # torchrun --max-restarts: how many, why, frames lost
        }
        self.progress.close()
        log.info("%s", phases_line(summary["phase_ms_per_step"], summary["phase_accounted"]))
        evaluations = [(row["frames"], row["eval_return"]) for row in self.eval_history]
        if eval_returns:
            if not self.eval_history or self.eval_history[-1]["frames"] != frames:
                # The final evaluation is the run's last metrics row, however short the run.
                self.log({"eval_return": summary["eval_return"]}, frames)
            evaluations.append((frames, summary["eval_return"]))
        learning_curve(self.run_dir / "learning_curve.png", self.train_history, evaluations, self.title)
        path = self.run_dir / "summary.json"
        path.write_text(json.dumps(summary, indent=2) + "\n")
        files = [path, self.run_dir / "learning_curve.png", self.run_dir / "config.yaml"]
        for logger in trackers(self.loggers):
            publish(logger, summary, files)
        for logger in self.loggers:
            logger.finalize("success")
        return path

    def log(self, row: dict[str, float], step: int) -> None:
        for logger in self.loggers:
            logger.log_metrics(row, step)


def phases_per_step(learners: list[dict[str, Any]]) -> dict[str, Any]:
    """Where the learners' training time went (timing.py): each phase's milliseconds per
    step, and the share of train_s the phases account for, both averaged over learners;
    and the seconds compiling took."""
    per_learner = [
        {
            name: 1000 * seconds / max(stats["rollouts"]["rollouts"], 1)
            for name, seconds in stats["phase_seconds"].items()
        }
        for stats in learners
    ]
    names = sorted({name for phases in per_learner for name in phases})
    return {
        "phase_ms_per_step": {
            name: sum(phases.get(name, 0.0) for phases in per_learner) / len(learners) for name in names
        },
        "phase_accounted": sum(sum(stats["phase_seconds"].values()) / stats["train_s"] for stats in learners)
        / len(learners),
        # compile=true: the seconds of the updates that compiled the loss, each update path's
        # first (the slowest learner's)
        "compile_s": max(stats["phase_seconds"].get("compile", 0.0) for stats in learners),
    }


def phases_line(ms_per_step: dict[str, float], accounted: float) -> str:
    """The phases in one line, the longest first."""
    phases = sorted(ms_per_step.items(), key=lambda item: -item[1])
    listed = ", ".join(f"{name} {ms:.1f} ms" for name, ms in phases)
    return f"time per step: {listed} ({accounted:.0%} of the training time)"


def make_loggers(cfg: DictConfig) -> list:
    """The loggers named in ``cfg.loggers``, each with its run opened: Fabric's CSV and
    TensorBoard loggers write straight into run_dir; Lightning's W&B and MLflow loggers log
    to ``cfg.experiment`` under the run_dir's name. W&B follows its own settings
    (``WANDB_MODE=offline``, ...); MLflow logs to ``MLFLOW_TRACKING_URI``, by default a
    SQLite file in this folder (MLflow's recommended local store; ``mlflow ui`` shows it).

    A logger that cannot reach its store (MLflow refuses ``file:`` stores unless
    ``MLFLOW_ALLOW_FILE_STORE=true``, say) stops the run in one line naming it."""
    run_name = Path(cfg.run_dir).name

    def wandb():
        # pytorch_lightning (the [wandb] and [mlflow] extras) is slow to import: only when asked.
        from pytorch_lightning.loggers import WandbLogger

        return WandbLogger(name=run_name, project=cfg.experiment, save_dir=cfg.run_dir)

    def mlflow():
        from pytorch_lightning.loggers import MLFlowLogger

        uri = os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")
        return MLFlowLogger(cfg.experiment, run_name, tracking_uri=uri)

    makers = {
        "csv": lambda: CSVLogger(cfg.run_dir, name="", version="", flush_logs_every_n_steps=1),
        "tensorboard": lambda: TensorBoardLogger(cfg.run_dir, name="", version="", default_hp_metric=False),
        "wandb": wandb,
        "mlflow": mlflow,
    }
    loggers = []
    for name in cfg.loggers:
        try:
            logger = makers[name]()
            # Its run opens now, before training.
            logger.experiment  # noqa: B018
        except Exception as error:  # whatever the tracker's client raises
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise RankFailure(f"loggers: {name} cannot log ({reason})") from None
        loggers.append(logger)
    return loggers


def trackers(loggers: list) -> list:
    """The experiment trackers among the loggers (W&B, MLflow): they take the config and the
    summary too. Told apart by class name, so that pytorch_lightning (slow to import) is
    imported only by runs that use one."""
    return [logger for logger in loggers if type(logger).__name__ in ("WandbLogger", "MLFlowLogger")]


def publish(logger: Any, summary: dict[str, Any], files: list[Path]) -> None:
    """Hand the run's summary to a tracker the way it keeps one: W&B's run summary (its
    numbers), MLflow's artifacts (the files)."""
    if type(logger).__name__ == "WandbLogger":
        logger.experiment.summary.update(
            {key: value for key, value in summary.items() if isinstance(value, (int, float))}
        )
        logger.experiment.finish()  # Lightning's finalize leaves the W&B run open
    else:
        for file in files:
            logger.experiment.log_artifact(logger.run_id, str(file))


def merge(rows: list[dict[str, float]]) -> dict[str, float]:
    merged = {}
    for key in dict.fromkeys(key for row in rows for key in row):
        values = [row[key] for row in rows if key in row and not math.isnan(row[key])]
        if not values:
            continue
        merged[key] = sum(values) if key in SUMMED else sum(values) / len(values)
    return merged


def logged_rows(run_dir: Path) -> list[tuple[int, dict[str, float]]]:
    """The rows of ``run_dir``'s metrics.csv, empty cells left out."""
    path = run_dir / "metrics.csv"
    if not path.is_file():
        return []
    with path.open(newline="") as file:
        return [
            (int(row.pop("step")), {key: float(value) for key, value in row.items() if value != ""})
            for row in csv.DictReader(file)
        ]


class Window:
    """A learner's metrics since its last report: throughput, mean losses (each over the
    updates that gave it: a recipe may log a loss on some updates only), finished episodes'
    returns, and the milliseconds per step of each phase of its steps."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.steps = 0
        self.frames = 0
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.updates = 0
        self.returns: list[float] = []

    def add_episodes(self, batch) -> None:
        self.steps += 1
        self.frames += batch.numel()
        done = batch["next", "done"].squeeze(-1)
        self.returns += batch["next", "episode_reward"].squeeze(-1)[done].tolist()

    def add_metrics(self, metrics: dict[str, torch.Tensor]) -> None:
        self.updates += 1
        for key, value in metrics.items():
            self.sums[key] = self.sums.get(key, 0.0) + value
            self.counts[key] = self.counts.get(key, 0) + 1

    def flush(self, phases: dict[str, float]) -> dict[str, float]:
        """The row, with ``phases`` (seconds per phase over the window, timing.take())."""
        elapsed = time.monotonic() - self.started
        row = {
            "frames_per_s": self.frames / elapsed,
            "updates_per_s": self.updates / elapsed,
            "train_return": sum(self.returns) / len(self.returns) if self.returns else math.nan,
        }
        row.update({key: float(total) / self.counts[key] for key, total in self.sums.items()})
        row.update(
            {f"ms_per_step/{name}": 1000 * seconds / max(self.steps, 1) for name, seconds in phases.items()}
        )
        self.__init__()
        return row
