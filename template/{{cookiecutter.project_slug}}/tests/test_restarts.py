"""Self-healing runs: under ``torchrun --max-restarts``, a killed learner or replay process
costs the run the frames since its newest checkpoint, not the run: torchelastic starts the
workers again, ``resume=auto`` takes them on from that checkpoint, and the run finishes
with its planned frames, saying in summary.json what happened."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from {{ cookiecutter.package_name }} import checkpoint

from .conftest import (
    RECIPES,
    REPLAY_RECIPE,
    free_port,
    launch,
    processes_of,
    tiny_overrides,
)
from .test_faults import finish

RECIPE = REPLAY_RECIPE or RECIPES[0]
EVERY = 2048  # frames between checkpoints: the most a failure may cost
FRAMES = 12288  # 24 steps of 2 learners x 256 frames


def torchrun(run_dir: Path) -> list[str]:
    """Two learners (and a replay process for a replay recipe) under torchelastic, allowed
    one restart, going on from their newest checkpoint whenever they start."""
    launcher = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    elastic = ["--max-restarts=1", "--nnodes=1", "--nproc-per-node=2", "--rdzv-backend=c10d"]
    elastic += [f"--rdzv-endpoint=127.0.0.1:{free_port()}"]
    overrides = [
        *tiny_overrides(RECIPE),
        f"total_frames={FRAMES}",
        f"checkpoint.every={EVERY}",
        "resume=auto",
    ]
    overrides += ["rpc.heartbeat_timeout=5", f"rpc.port={free_port()}", "fabric.strategy=ddp"]
    overrides += ["fabric.accelerator=cpu", f"run_dir={run_dir}"]
    return [launcher, *elastic, "train.py", *overrides]


@pytest.mark.slow
@pytest.mark.parametrize(
    "victim",
    [1, pytest.param(2, marks=pytest.mark.skipif(REPLAY_RECIPE is None, reason="no replay process"))],
    ids=["learner", "replay"],
)
def test_a_killed_process_costs_at_most_the_frames_since_the_last_checkpoint(tmp_path, victim):
    run_dir = tmp_path / "run"
    process = launch(torchrun(run_dir))
    deadline = time.monotonic() + 180
    while not checkpoint.complete(run_dir):
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no checkpoint was written"
        time.sleep(0.5)
    ranks = {rank: pid for pid, rank in processes_of(run_dir).items() if rank is not None}
    os.kill(ranks[victim], signal.SIGKILL)

    code, stderr, _ = finish(process, timeout=300)
    assert code == 0, stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["frames_collected"] == FRAMES
    assert summary["restarts"] == 1
    (failure,) = summary["failures"]
    role = "learner" if victim == 1 else "replay"
    assert f"rank {victim} ({role})" in failure["reason"], failure
    assert 0 <= failure["frames_lost"] <= EVERY
    assert summary["resumed_from"] is not None
    assert len(set(summary["learner_param_checksums"].values())) == 1
    if REPLAY_RECIPE is not None:
        assert summary["replay_size"] == FRAMES  # the checkpoint's transitions, and each new one once
    assert processes_of(run_dir) == {}, "nothing of either attempt may outlive the run"
