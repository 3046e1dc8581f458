"""Faults and signals on real ranks: a killed rank stops the run, Ctrl-C stops it cleanly,
a non-finite loss is reported with its step. Nothing hangs, nothing is left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from {{ cookiecutter.package_name }} import checkpoint
from {{ cookiecutter.package_name }}.topology import Topology

from .conftest import (
    RECIPES,
    REPLAY_RECIPE,
    fabric_command,
    free_port,
    launch,
    processes_of,
    tiny_overrides,
)

RECIPE = REPLAY_RECIPE or RECIPES[0]
# Long enough to be mid-training when the test strikes; short heartbeats to notice quickly.
LONG_RUN = [*tiny_overrides(RECIPE), "total_frames=10000000", "rpc.heartbeat_timeout=5"]


def start(command: list[str], run_dir: Path) -> subprocess.Popen:
    """Start a run and wait until it trains: rank 0 writes config.yaml before the ranks
    connect."""
    process = launch(command)
    deadline = time.monotonic() + 120
    while not (run_dir / "config.yaml").exists():
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run did not start"
        time.sleep(0.5)
    time.sleep(10)  # connect, collect, update
    return process


def finish(process: subprocess.Popen, timeout: float) -> tuple[int, str, float]:
    started = time.monotonic()
    try:
        _, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    return process.returncode, stderr, time.monotonic() - started


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 2], ids=["rank0", "rank2"])
def test_a_killed_rank_stops_every_other_rank_within_60_s(tmp_path, victim):
    run_dir = tmp_path / "run"
    command = fabric_command(3, "train.py", f"rpc.port={free_port()}", *LONG_RUN, f"run_dir={run_dir}")
    process = start(command, run_dir)
    ranks = {rank: pid for pid, rank in processes_of(run_dir).items() if rank is not None}
    assert sorted(ranks) == [0, 1, 2]
    os.kill(ranks[victim], signal.SIGKILL)

    code, stderr, seconds = finish(process, timeout=90)
    assert code != 0 and seconds < 60
    role = Topology.plan(3, victim, 1, uses_replay=REPLAY_RECIPE is not None).role
    survivors = [rank for rank in ranks if rank != victim]
    for rank in survivors:
        # Each survivor names the rank that died and its role, on one line.
        lines = [
            line for line in stderr.splitlines() if line.startswith(f"[rank {rank} ") and "stopping:" in line
        ]
        assert len(lines) == 1, stderr[-3000:]
        assert f"rank {victim} ({role})" in lines[0]
    assert processes_of(run_dir) == {}, "no rank may outlive the run"


@pytest.mark.slow
def test_ctrl_c_stops_all_ranks_cleanly_and_keeps_the_records(tmp_path):
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "train.py",
        "fabric.devices=3",
        "fabric.accelerator=cpu",
        f"rpc.port={free_port()}",
    ]
    # Checkpoints on, but none due before the signal: the stop writes one.
    process = start([*command, *LONG_RUN, "checkpoint.every=5000000", f"run_dir={run_dir}"], run_dir)
    os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C does: every process of the terminal's group

    code, stderr, seconds = finish(process, timeout=90)
    assert code == 128 + signal.SIGINT, stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGINT"
    assert 0 < summary["frames_collected"] < 10_000_000
    assert len(set(summary["learner_param_checksums"].values())) == 1
    assert (run_dir / "checkpoints" / "final.pt").is_file()
    assert checkpoint.read_meta(checkpoint.latest(run_dir))["frames"] == summary["frames_collected"]
    assert processes_of(run_dir) == {}


@pytest.mark.slow
def test_a_non_finite_loss_stops_the_run_and_says_where(tmp_path):
    run_dir = tmp_path / "run"
    # A discount that is not a number: no recipe's loss can be finite with it.
    overrides = [*tiny_overrides(RECIPE), "algo.gamma=nan", "rpc.heartbeat_timeout=5", f"run_dir={run_dir}"]
    process = launch(fabric_command(3, "train.py", f"rpc.port={free_port()}", *overrides))
    code, stderr, _ = finish(process, timeout=120)
    assert code != 0
    reports = [line for line in stderr.splitlines() if "stopping:" in line]
    # Every rank says so: the learners that saw it, and the others. (A learner may say it
    # twice, when another learner's report reaches it while it reports its own.)
    assert {line.split(" ")[1] for line in reports} == {"0", "1", "2"}, stderr[-3000:]
    assert all("(learner) failed: non-finite loss" in line and "at frame" in line for line in reports)
    assert processes_of(run_dir) == {}
