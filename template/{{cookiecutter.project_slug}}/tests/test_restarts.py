"""Self-healing runs: under ``torchrun --max-restarts``, a killed learner or replay process
costs the run the frames since its newest checkpoint, not the run: torchelastic starts the
workers again, ``resume=auto`` takes them on from that checkpoint, and the run finishes
with its planned frames, saying in summary.json what happened."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from {{ cookiecutter.package_name }} import checkpoint

from .conftest import (
    REPLAY_RECIPE,
    RUNTIME_RECIPE,
    free_port,
    launch,
    needs_runtime_recipe,
    processes_of,
    tiny_overrides,
)
from .test_faults import finish, parent_of

RECIPE = RUNTIME_RECIPE
pytestmark = needs_runtime_recipe
EVERY = 2048  # frames between checkpoints: the most a failure may cost
FRAMES = 12288  # 24 steps of 2 learners x 256 frames


def torchrun(
    run_dir: Path, nodes: str = "1", per_node: int = 2, endpoint: str | None = None, restarts: int = 1
) -> list[str]:
    """Learners (and a replay process for a replay recipe) under torchelastic, allowed
    ``restarts`` restarts, going on from their newest checkpoint whenever they start:
    ``per_node`` learners on each of ``nodes`` nodes (one agent per node, all meeting at
    ``endpoint``)."""
    launcher = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    elastic = [f"--max-restarts={restarts}", f"--nnodes={nodes}", f"--nproc-per-node={per_node}"]
    elastic += ["--rdzv-backend=c10d"]
    elastic += [f"--rdzv-endpoint={endpoint or f'127.0.0.1:{free_port()}'}", "--local-addr=127.0.0.1"]
    # A re-formed job waits this long for nodes beyond the fewest it may run with.
    elastic += ["--rdzv-conf=last_call_timeout=10"]
    overrides = [
        *tiny_overrides(RECIPE),
        f"total_frames={FRAMES}",
        f"checkpoint.every={EVERY}",
        "resume=auto",
    ]
    overrides += ["rpc.heartbeat_timeout=5", "fabric.strategy=ddp"]
    overrides += ["fabric.accelerator=cpu", f"run_dir={run_dir}"]
    return [launcher, *elastic, "train.py", *overrides]


def wait_for_checkpoint(process, run_dir: Path, after: int = -1) -> int:
    """The frames of the first complete checkpoint in ``run_dir`` past ``after`` frames."""
    deadline = time.monotonic() + 180
    while True:
        # By name: the run may delete an older one meanwhile (checkpoint.keep).
        saved = [int(folder.name.removeprefix(checkpoint.PREFIX)) for folder in checkpoint.complete(run_dir)]
        if any(frames > after for frames in saved):
            return min(frames for frames in saved if frames > after)
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"no checkpoint past {after} frames was written"
        time.sleep(0.5)


# A learner, then (for a replay recipe) the replay process of the restarted workers: each
# costs the frames since the newest checkpoint, and the second heals as the first did.
VICTIMS = [1] if REPLAY_RECIPE is None else [1, 2]


@pytest.mark.slow
def test_each_killed_process_costs_at_most_the_frames_since_the_last_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    process = launch(torchrun(run_dir, restarts=len(VICTIMS)))
    frames = -1
    for victim in VICTIMS:
        frames = wait_for_checkpoint(process, run_dir, after=frames)
        ranks = {rank: pid for pid, rank in processes_of(run_dir).items() if rank is not None}
        os.kill(ranks[victim], signal.SIGKILL)

    code, stderr, _ = finish(process, timeout=300)
    assert code == 0, stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["frames_collected"] == FRAMES
    assert summary["restarts"] == len(VICTIMS)
    failures = summary["failures"]
    assert len(failures) == len(VICTIMS), failures
    for victim, failure in zip(VICTIMS, failures, strict=True):
        role = "learner" if victim == 1 else "replay"
        assert f"rank {victim} ({role})" in failure["reason"], failure
        assert 0 <= failure["frames_lost"] <= EVERY
    assert summary["resumed_from"] is not None
    assert len(set(summary["learner_param_checksums"].values())) == 1
    if REPLAY_RECIPE is not None:
        assert summary["replay_size"] == FRAMES  # the checkpoint's transitions, and each new one once
    assert processes_of(run_dir) == {}, "nothing of any attempt may outlive the run"


@pytest.mark.slow
def test_a_node_that_dies_leaves_the_other_training_with_fewer_learners(tmp_path):
    """Two torchrun agents on this machine as two nodes of one learner each, under an
    elastic rendezvous (1 to 2 nodes). The second node dies whole; the first goes on alone,
    one learner, from the newest checkpoint, to the planned frames."""
    run_dir = tmp_path / "run"
    port = free_port()
    command = torchrun(run_dir, nodes="1:2", per_node=1, endpoint=f"127.0.0.1:{port}")
    first = launch(command)
    # The first node hosts the rendezvous (the job cannot outlive it) and, there first, is
    # node 0: rank 0, which keeps the records and starts the replay process.
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert first.poll() is None, first.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the first node's rendezvous did not start"
            time.sleep(0.2)
    second = launch(command)
    wait_for_checkpoint(first, run_dir)
    (learner,) = [pid for pid, rank in processes_of(run_dir).items() if rank == 1]
    assert parent_of(learner) == second.pid
    for pid in (second.pid, learner):  # the node, all of it
        os.kill(pid, signal.SIGKILL)

    code, stderr, _ = finish(first, timeout=300)
    assert code == 0, stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["roles"] == {"0": "learner"}  # one learner, its replay in its own process
    assert summary["frames_collected"] == FRAMES
    assert summary["restarts"] == 1
    (failure,) = summary["failures"]
    assert "rank 1 (learner)" in failure["reason"], failure
    assert 0 <= failure["frames_lost"] <= EVERY
    assert summary["resumed_from"] is not None
    if REPLAY_RECIPE is not None:
        assert summary["replay_size"] == FRAMES
    assert processes_of(run_dir) == {}, "nothing of either node may outlive the run"
