"""slurm.sh under a real SLURM: a one-node cluster (slurmctld, slurmd and munge, started
here for this module in a temporary folder) runs the job as a cluster would: sbatch, srun
starting torchrun, a rank killed and restarted, SIGUSR1 before the time limit, the requeue,
and the requeued job finishing the run; two jobs of the same recipe, env and seed each in
a run_dir of their own.

It needs SLURM's daemons (Debian's ``slurm-wlm`` and ``munge``; ``make test`` installs them
when it runs as root) and root, as SLURM's daemons do. Without them it is skipped, unless
REQUIRE_SLURM=1 (what ``make test`` sets where it installed them): then it fails.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from {{ cookiecutter.package_name }} import checkpoint

from .conftest import (
    PROJECT,
    RUNTIME_RECIPE,
    command_env,
    free_port,
    needs_runtime_recipe,
    processes_of,
    tiny_overrides,
)

RECIPE = RUNTIME_RECIPE
pytestmark = needs_runtime_recipe
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol")
EVERY = 2048  # frames between checkpoints: the most the killed rank may cost
# About 90 s of training (2.3 s a step of 512 frames: each of the 2 learners steps its 8
# copies 32 times, 8 ms a step): longer than the first job trains before its time limit's
# warning, which comes a minute or so in. The env sleeps rather than the learners working
# harder, so the job leaves the cores to the tests beside it: the stragglers benchmark's
# CartPole, which sleeps SIMULATOR_STEP_S a step on every rank.
FRAMES = 20480
SLOW_ENV = "env.id=benchmarks.stragglers:StragglerCartPole-v1"


def sbin(name: str) -> str | None:
    """Where ``name`` is: on PATH, or in /usr/sbin (SLURM's and munge's daemons)."""
    return shutil.which(name, path=os.environ["PATH"] + os.pathsep + "/usr/sbin")


missing = [name for name in DAEMONS if sbin(name) is None]
if missing or os.geteuid() != 0:
    why = f"needs {', '.join(missing)}" if missing else "SLURM's daemons run as root"
    if os.environ.get("REQUIRE_SLURM") == "1":
        raise RuntimeError(f"REQUIRE_SLURM=1, but a real SLURM cannot run here: {why}")
    pytest.skip(f"a real SLURM {why}", allow_module_level=True)

SLURM_CONF = """\
ClusterName=test
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
AuthInfo=socket={root}/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
JobRequeue=1
MpiDefault=none
ReturnToService=2
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
NodeName={host} CPUs={cpus} RealMemory=4000 State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> Iterator[dict[str, str]]:
    """A one-node SLURM cluster of this machine; yields the environment its commands need."""
    root = tmp_path_factory.mktemp("slurm")
    for folder in ("state", "spool"):
        (root / folder).mkdir()
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    conf = root / "slurm.conf"
    conf.write_text(
        SLURM_CONF.format(
            host=socket.gethostname(),
            ctld_port=free_port(),
            d_port=free_port(),
            root=root,
            cpus=os.cpu_count(),
        )
    )
    (root / "cgroup.conf").write_text("CgroupPlugin=autodetect\nIgnoreSystemd=yes\n")
    # The job's commands (torchrun, python) from this venv, as after `source .venv/bin/activate`.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])
    env = {**command_env(), "SLURM_CONF": str(conf), "PATH": path}
    munge = [sbin("munged"), "--force", f"--key-file={key}", f"--socket={root}/munge.socket"]
    munge += [f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log"]
    munge += [f"--seed-file={root}/munge.seed"]
    subprocess.run(munge, check=True, env=env)
    subprocess.run([sbin("slurmctld"), "-f", str(conf)], check=True, env=env)
    subprocess.run([sbin("slurmd"), "-f", str(conf)], check=True, env=env)
    try:
        deadline = time.monotonic() + 60
        sinfo = ["sinfo", "--noheader", "--format=%T"]
        while "idle" not in subprocess.run(sinfo, env=env, capture_output=True, text=True).stdout:
            assert time.monotonic() < deadline, (root / "slurmctld.log").read_text()[-3000:]
            time.sleep(0.5)
        yield env
    finally:
        subprocess.run(["scancel", "--full", "--user=root"], env=env, capture_output=True)
        for daemon in ("slurmd", "slurmctld", "munged"):
            pid_file = root / f"{daemon}.pid"
            if pid_file.exists():
                try:
                    os.kill(int(pid_file.read_text()), signal.SIGTERM)
                except ProcessLookupError:
                    pass


ALIVE = ("PENDING", "RUNNING", "REQUEUED", "COMPLETING")  # a job's states before it ends


def job_state(env: dict[str, str], job: str) -> tuple[str, str]:
    """The job's state and the reason SLURM gives for it."""
    shown = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    fields = dict(word.split("=", 1) for word in shown.split() if "=" in word)
    return fields.get("JobState", "UNKNOWN"), fields.get("Reason", "")


def test_a_job_heals_a_killed_rank_stops_before_its_time_limit_and_its_requeue_finishes(slurm, tmp_path):
    run_dir = tmp_path / "run"
    output = tmp_path / "job.out"
    # One node, two learners (and a replay process), a 3-minute limit: the warning comes a
    # minute or so in (SLURM checks its limits every 30 s or so, and signals early rather
    # than late), and a checkpoint every 2048 frames.
    sbatch = ["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", f"--cpus-per-task={os.cpu_count()}"]
    sbatch += ["--time=3", "--signal=B:USR1@120", f"--output={output}", "slurm.sh", "fabric.accelerator=cpu"]
    sbatch += [*tiny_overrides(RECIPE), SLOW_ENV, "eval.every=0", "eval.episodes=2"]
    sbatch += [f"total_frames={FRAMES}", f"checkpoint.every={EVERY}"]
    sbatch += ["rpc.heartbeat_timeout=5", f"run_dir={run_dir}"]
    env = {**slurm, "LEARNERS_PER_NODE": "2", "SIMULATOR_STEP_S": "0.008"}  # sbatch passes it on
    job = subprocess.run(sbatch, env=env, capture_output=True, text=True, check=True).stdout.strip()

    def log() -> str:
        return output.read_text() if output.exists() else ""

    deadline = time.monotonic() + 120
    while not checkpoint.complete(run_dir):
        assert job_state(slurm, job)[0] in ("PENDING", "RUNNING"), log()[-3000:]
        assert time.monotonic() < deadline, f"no checkpoint was written\n{log()[-3000:]}"
        time.sleep(0.5)
    # A learner dies inside the job: torchrun starts the learners again from this checkpoint.
    (learner,) = [pid for pid, rank in processes_of(run_dir).items() if rank == 1]
    os.kill(learner, signal.SIGKILL)

    # The time limit's warning: every rank stops at one checkpoint, and slurm.sh requeues
    # the job. SLURM holds a requeued job for two minutes before it may start again; the
    # test waits 2 s of that and then releases it (StartTime=now, which also schedules it at
    # once), and gives the job time to finish the run (TimeLimit=10) rather than stop and
    # requeue again a minute later. The 2 s: slurmd refuses to launch a job whose credential
    # is no newer, in whole seconds, than its kill of the job's last run ("Job credential
    # revoked"), and the job then ends FAILED.
    deadline = time.monotonic() + 420
    stops = []
    while (state := job_state(slurm, job))[0] != "COMPLETED":
        assert state[0] in (*ALIVE, "COMPLETED"), f"{state}\n{log()[-3000:]}"
        assert time.monotonic() < deadline, f"the job did not finish ({state})\n{log()[-3000:]}"
        # Requeued, and not yet released (it waits for its StartTime as PENDING BeginTime).
        if state == ("PENDING", "BeginTime") and log().count("requeueing job") > len(stops):
            summary = json.loads((run_dir / "summary.json").read_text())
            if not stops:
                assert summary["restarts"] == 1, summary
                assert "rank 1 (learner)" in summary["failures"][0]["reason"], summary
                assert 0 <= summary["failures"][0]["frames_lost"] <= EVERY
            assert summary["stopped_by"] == "SIGUSR1", log()[-3000:]
            stops.append(summary["frames_collected"])
            assert checkpoint.Meta.read(checkpoint.latest(run_dir)).frames == stops[-1]
            time.sleep(2)
            release = ["scontrol", "update", f"JobId={job}", "StartTime=now", "TimeLimit=10"]
            subprocess.run(release, env=slurm, check=True)
        time.sleep(0.5)

    assert stops, f"the job finished before its time limit's warning\n{log()[-3000:]}"
    assert log().count("requeueing job") == len(stops)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["frames_collected"] == FRAMES
    assert summary["stopped_by"] is None
    assert summary["resumed_from"] == str(checkpoint.training_dir(run_dir, stops[-1]))
    assert len(set(summary["learner_param_checksums"].values())) == 1
    assert processes_of(run_dir) == {}, "nothing of the job may outlive it"


def test_two_jobs_of_the_same_recipe_env_and_seed_do_not_share_a_run_dir(slurm, tmp_path):
    """Neither names a run_dir: each writes into the one slurm.sh names by its job id, and
    the second does not go on from the first's checkpoints (both run resume=auto)."""
    options = ["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", f"--cpus-per-task={os.cpu_count()}"]
    arguments = ["slurm.sh", "fabric.accelerator=cpu", *tiny_overrides(RECIPE), "total_frames=512"]
    arguments += ["checkpoint.every=256"]
    env = {**slurm, "LEARNERS_PER_NODE": "1"}
    jobs = {}
    for name in ("first", "second"):
        output = tmp_path / f"{name}.out"
        command = [*options, "--time=5", f"--output={output}", *arguments]
        submitted = subprocess.run(command, cwd=PROJECT, env=env, capture_output=True, text=True, check=True)
        jobs[submitted.stdout.strip()] = output
    try:
        deadline = time.monotonic() + 300
        run_dirs = set()
        for job, output in jobs.items():
            while (state := job_state(slurm, job))[0] != "COMPLETED":
                log = output.read_text() if output.exists() else ""
                assert state[0] in ALIVE, f"{state}\n{log[-3000:]}"
                assert time.monotonic() < deadline, f"job {job} did not finish ({state})\n{log[-3000:]}"
                time.sleep(0.5)
            (line,) = [line for line in output.read_text().splitlines() if line.startswith("summary: ")]
            summary_path = PROJECT / line.removeprefix("summary: ")
            assert summary_path.parent.name.endswith(f"-seed0-job{job}"), summary_path
            summary = json.loads(summary_path.read_text())
            assert summary["frames_collected"] == 512 and summary["resumed_from"] is None, summary
            run_dirs.add(summary_path.parent)
        assert len(run_dirs) == 2
    finally:
        subprocess.run(["scancel", *jobs], env=slurm, capture_output=True)
        for job in jobs:
            for run_dir in (PROJECT / "runs").glob(f"*-job{job}"):
                shutil.rmtree(run_dir)
