"""A run's record of its failures and restarts: ``run_dir/failures.jsonl``.

Under ``torchrun --max-restarts=N`` (torchelastic) a failed attempt's workers are all
stopped and started again, ``TORCHELASTIC_RESTART_COUNT`` telling them which attempt they
are, and ``resume=auto`` takes them on from the newest whole checkpoint. Each process that
gives up writes why (``failed``); the restarted attempt's rank 0 writes where it went on
from (``restarted``). The summary (``summary``) says how many restarts there were, why,
and how many frames each lost: those the failed attempt had logged beyond the checkpoint
the next one went on from (a lower bound: frames after its last metrics row are not
counted, at most ``log_every`` more).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

FILE = "failures.jsonl"


def attempt() -> int:
    """This attempt's number: 0 for the first, and one more for each restart."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _append(run_dir: str | Path, record: dict[str, Any]) -> None:
    path = Path(run_dir) / FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as file:  # one short line per write: appends from several processes stay whole
        file.write(json.dumps(record) + "\n")


def failed(run_dir: str | Path, rank: int, reason: str) -> None:
    """Rank ``rank`` of this attempt gives up, for ``reason``."""
    _append(run_dir, {"attempt": attempt(), "rank": rank, "reason": reason})


def restarted(run_dir: str | Path, resumed_frames: int, frames_reached: int) -> None:
    """A restarted attempt goes on from ``resumed_frames``; the attempt before it had logged
    up to ``frames_reached``."""
    _append(
        run_dir, {"attempt": attempt(), "resumed_frames": resumed_frames, "frames_reached": frames_reached}
    )


def start(run_dir: str | Path) -> None:
    """A run's first attempt begins afresh: an earlier run's record in this run_dir goes."""
    if attempt() == 0:
        (Path(run_dir) / FILE).unlink(missing_ok=True)


def summary(run_dir: str | Path) -> dict[str, Any]:
    """``restarts`` and, per failed attempt, ``failures``: its first reason and the frames it lost."""
    path = Path(run_dir) / FILE
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    failures = []
    for number in range(attempt()):
        reasons = [
            record["reason"] for record in records if record["attempt"] == number and "reason" in record
        ]
        after = next((r for r in records if r["attempt"] == number + 1 and "resumed_frames" in r), None)
        lost = max(0, after["frames_reached"] - after["resumed_frames"]) if after else None
        failures.append({"attempt": number, "reason": reasons[0] if reasons else None, "frames_lost": lost})
    return {"restarts": attempt(), "failures": failures}
