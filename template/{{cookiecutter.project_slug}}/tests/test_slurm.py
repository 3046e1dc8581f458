"""slurm.sh on this machine as SLURM would run it: the environment of a 2-task allocation,
srun starting the tasks, the signal SLURM sends before the time limit, and a requeue.

No SLURM here: `srun` and `scontrol` are small stand-ins on PATH. `srun` starts
SLURM_NTASKS copies of its command with the variables real srun gives each task;
`scontrol` records how it was called.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from {{ cookiecutter.package_name }} import checkpoint

from .conftest import RECIPES, REPLAY_RECIPE, command_env, free_port, launch, processes_of, tiny_overrides

RECIPE = REPLAY_RECIPE or RECIPES[0]

SRUN = """
import os, subprocess, sys
tasks = [
    subprocess.Popen(sys.argv[1:], env=dict(os.environ, SLURM_PROCID=str(i), SLURM_LOCALID=str(i)))
    for i in range(int(os.environ["SLURM_NTASKS"]))
]
sys.exit(max(task.wait() for task in tasks))
"""
SCONTROL = """#!/bin/bash
echo "$@" >> "$SCONTROL_LOG"
"""


def job_id() -> int:
    """A job id whose block of ports (slurm.sh: 15000 + id % 15000 * 3, and the two after)
    is free here."""
    while True:
        port = free_port()
        if 15000 <= port < 60000 and (port - 15000) % 3 == 0:
            return (port - 15000) // 3


def slurm_environment(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", f"#!{sys.executable}{SRUN}"), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {key: value for key, value in command_env().items() if not key.startswith(("SLURM_", "MASTER_"))}
    return {
        **env,
        "PATH": os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), env["PATH"]]),
        "SCONTROL_LOG": str(tmp_path / "scontrol.log"),
        # What an allocation of one node and 2 tasks sets (sbatch --nodes=1 --ntasks-per-node=2).
        "SLURM_JOB_ID": str(job_id()),
        "SLURM_JOB_NAME": "my-job",
        "SLURM_NNODES": "1",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_NODEID": "0",
        "SLURM_CPUS_PER_TASK": "1",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_NODELIST": "localhost",
    }


def sbatch(env: dict[str, str], *overrides: str) -> subprocess.Popen:
    """What the batch job runs on its first node (its own session, output captured)."""
    return launch(["bash", "slurm.sh", "fabric.accelerator=cpu", *tiny_overrides(RECIPE), *overrides], env)


def test_slurms_warning_checkpoints_every_rank_requeues_and_the_requeued_job_goes_on(tmp_path):
    run_dir = tmp_path / "run"
    env = slurm_environment(tmp_path)
    long_run = ["total_frames=10000000", "checkpoint.every=5000000", f"run_dir={run_dir}"]
    job = sbatch(env, *long_run)
    deadline = time.monotonic() + 180
    metrics = run_dir / "metrics.csv"
    # Training: the first metrics row (log_every=1024 frames) is in.
    while not (metrics.exists() and len(metrics.read_text().splitlines()) > 1):
        assert job.poll() is None, job.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the job did not start training"
        time.sleep(0.5)
    # The two tasks are the learners; a replay recipe's replay process is rank 2.
    tasks = {rank: pid for pid, rank in processes_of(run_dir).items() if rank is not None}
    assert sorted(tasks) == ([0, 1, 2] if REPLAY_RECIPE else [0, 1])
    for pid in tasks.values():  # #SBATCH --signal=USR1@90 signals every process of the job
        os.kill(pid, signal.SIGUSR1)
    try:
        _, stderr = job.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        raise
    assert job.returncode == 128 + signal.SIGUSR1, stderr[-3000:]
    assert (tmp_path / "scontrol.log").read_text().splitlines() == [f"requeue {env['SLURM_JOB_ID']}"]
    assert f"SLURM job {env['SLURM_JOB_ID']} requeued" in stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGUSR1"
    stopped_at = checkpoint.Meta.read(checkpoint.latest(run_dir)).frames
    assert stopped_at == summary["frames_collected"] > 0
    assert processes_of(run_dir) == {}

    # The requeued job: the same script and overrides, to a nearer end.
    total = stopped_at + 2048
    job = sbatch(env, *long_run, f"total_frames={total}")
    _, stderr = job.communicate(timeout=300)
    assert job.returncode == 0, stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"] == str(checkpoint.training_dir(run_dir, stopped_at))
    assert summary["frames_collected"] >= total
    assert (tmp_path / "scontrol.log").read_text().count("requeue") == 1
