"""Faults and signals on real ranks: a killed rank stops the run, so does a killed launcher,
Ctrl-C stops it cleanly, a non-finite loss is reported with its step. Nothing hangs, nothing
is left behind, and nothing a run listens on is reachable beyond loopback."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from {{ cookiecutter.package_name }} import checkpoint, recipes
from {{ cookiecutter.package_name }}.collector import collecting
from {{ cookiecutter.package_name }}.distributed.topology import Topology

from .conftest import (
    RECIPES,
    REPLAY_RECIPE,
    RUNTIME_RECIPE,
    environment_of,
    fabric_command,
    fabric_launcher_env,
    free_port,
    launch,
    needs_runtime_recipe,
    processes_of,
    run_command,
    tiny_overrides,
)

RECIPE = RUNTIME_RECIPE
pytestmark = needs_runtime_recipe
# Three processes: two learners and a replay process, or three learners (on-policy).
DEVICES = 2 if REPLAY_RECIPE is not None else 3
LEARNERS = list(range(DEVICES))
# Long enough to be mid-training when the test strikes; short heartbeats to notice quickly.
LONG_RUN = [*(tiny_overrides(RECIPE) if RECIPE else []), "total_frames=10000000", "rpc.heartbeat_timeout=5"]


LISTEN = "0A"  # the TCP state of a listening socket in /proc/net/tcp


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process ``pid`` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != LISTEN or fields[9] not in inodes:
                continue
            address, port = fields[1].split(":")
            # The kernel prints the address as 32-bit words in host (little-endian) order.
            raw = b"".join(bytes.fromhex(address[i : i + 8])[::-1] for i in range(0, len(address), 8))
            found.add((socket.inet_ntop(family, raw), int(port, 16)))
    return found


def start(command: list[str], run_dir: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a run and wait until it trains: rank 0 logs a metrics row once every learner
    has collected and reported."""
    process = launch(command, env)
    metrics, deadline = run_dir / "metrics.csv", time.monotonic() + 180
    while not metrics.is_file() or len(metrics.read_text().splitlines()) < 2:
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run did not start training"
        time.sleep(0.5)
    return process


def finish(process: subprocess.Popen, timeout: float) -> tuple[int, str, float]:
    started = time.monotonic()
    try:
        _, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"the run did not end within {timeout} s:\n{process.communicate()[1][-3000:]}")
    return process.returncode, stderr, time.monotonic() - started


def failed_within_60_s(process: subprocess.Popen) -> str:
    """The standard error of a run that a fault must end, with an error, within 60 s."""
    code, stderr, seconds = finish(process, timeout=90)
    assert code != 0 and seconds < 60, f"exit code {code} after {seconds:.0f} s:\n{stderr[-3000:]}"
    return stderr


def parent_of(pid: int) -> int:
    return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])


def collector_processes(pid: int) -> list[int]:
    """The collector processes (async, or workers) of process ``pid``: the children of its
    multiprocessing fork server, which forks them (collector.py)."""
    children: dict[int, list[int]] = {}
    commands = {}
    for entry in Path("/proc").iterdir():
        try:
            children.setdefault(parent_of(int(entry.name)), []).append(int(entry.name))
            commands[int(entry.name)] = (entry / "cmdline").read_text()
        except (OSError, ValueError, IndexError):
            continue

    # Forked children only: the server's imports run other Pythons of their own (mujoco's
    # glfw asks one for its library's version).
    def forked(parent: int) -> list[int]:
        return [child for child in children.get(parent, []) if "forkserver" in commands.get(child, "")]

    return [collector for server in forked(pid) for collector in forked(server)]


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 2], ids=["rank0", "rank2"])
def test_a_killed_rank_stops_every_other_rank_within_60_s(tmp_path, victim):
    run_dir = tmp_path / "run"
    # The learners collect in async mode: a killed learner must take its collector along.
    mode = "async" if REPLAY_RECIPE is not None else "sync"
    overrides = [*LONG_RUN, f"collector.mode={mode}", f"run_dir={run_dir}"]
    process = start(fabric_command(DEVICES, "train.py", *overrides), run_dir)
    ranks = {rank: pid for pid, rank in processes_of(run_dir).items() if rank is not None}
    assert sorted(ranks) == [0, 1, 2]
    collectors = [pid for rank in ranks.values() for pid in collector_processes(rank)]
    assert len(collectors) == (2 if mode == "async" else 0)
    os.kill(ranks[victim], signal.SIGKILL)

    stderr = failed_within_60_s(process)
    role = Topology.plan(DEVICES, victim, 1, uses_replay=REPLAY_RECIPE is not None).role
    survivors = [rank for rank in ranks if rank != victim]
    for rank in survivors:
        # Each survivor names the rank that died and its role, on one line.
        lines = [
            line for line in stderr.splitlines() if line.startswith(f"[rank {rank} ") and "stopping:" in line
        ]
        assert len(lines) == 1, stderr[-3000:]
        assert f"rank {victim} ({role})" in lines[0]
    assert processes_of(run_dir) == {}, "no rank may outlive the run"
    assert not any(alive(pid) for pid in collectors), "no collector may outlive the run"


@pytest.mark.slow
@pytest.mark.skipif(REPLAY_RECIPE is None, reason="async collection is for replay recipes")
@pytest.mark.parametrize("fault", ["dies", "dies starting", "hangs"])
def test_an_async_collector_that_dies_or_hangs_stops_the_run(tmp_path, fault):
    run_dir = tmp_path / "run"
    overrides = [*LONG_RUN, "collector.mode=async", "collector.timeout=10", f"run_dir={run_dir}"]
    command = fabric_command(DEVICES, "train.py", *overrides)
    if fault == "dies starting":  # as soon as it is there, before it has made its env
        process, deadline = launch(command), time.monotonic() + 180
        # Seen twice: the fork server's own short-lived children (its imports run a Python
        # that reports a library's version) look like a collector until they exec.
        seen: list[int] = []
        while len(seen) < 2 or seen[-1] != seen[-2]:
            assert process.poll() is None, process.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no collector process started"
            learners = [pid for pid, rank in processes_of(run_dir).items() if rank == 1]
            collectors = collector_processes(learners[0]) if learners else []
            seen = [*seen, *collectors] if len(collectors) == 1 else []
            time.sleep(0.02)
        collector = seen[-1]
        assert not (run_dir / "metrics.csv").exists()
    else:
        process = start(command, run_dir)
        learner = next(pid for pid, rank in processes_of(run_dir).items() if rank == 1)
        (collector,) = collector_processes(learner)
    os.kill(collector, signal.SIGSTOP if fault == "hangs" else signal.SIGKILL)

    stderr = failed_within_60_s(process)
    died = "rank 1 (learner) failed: the collector process of rank 1 (learner), collecting from "
    died += "CartPole-v1, died "
    killed = died + "(killed by SIGKILL)"
    reasons = {
        "dies": [killed],
        # Killed before it has read what it is to run, it is not yet a process with an exit code.
        "dies starting": [killed, died + "(as it started)"],
        "hangs": ["the collector of rank 1 (learner) stopped: nothing for 10 s"],
    }[fault]
    # The learners say why. (Rank 0 kills the replay process as it stops, which may come
    # before that process has said anything.)
    for rank in LEARNERS:
        lines = [
            line for line in stderr.splitlines() if line.startswith(f"[rank {rank} ") and "stopping:" in line
        ]
        assert lines and any(reason in lines[0] for reason in reasons), stderr[-3000:]
    # One line says it all: no rank prints a traceback (the launcher prints its own).
    assert '/learner.py", line' not in stderr, stderr[-3000:]
    assert processes_of(run_dir) == {} and not alive(collector), "nothing may outlive the run"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_collector_worker_that_dies_stops_the_run_naming_it(tmp_path, mode):
    run_dir = tmp_path / "run"
    overrides = [*LONG_RUN, "collector.workers=2", f"collector.mode={mode}", f"run_dir={run_dir}"]
    process = start(fabric_command(DEVICES, "train.py", *overrides), run_dir)
    learner = next(pid for pid, rank in processes_of(run_dir).items() if rank == 1)
    workers = sorted(collector_processes(learner))  # started in order: worker 0, then 1
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGKILL)

    stderr = failed_within_60_s(process)
    reason = "rank 1 (learner) failed: the collector process of rank 1 (learner), collecting from "
    reason += "CartPole-v1, died (worker 1 of 2: killed by SIGKILL)"
    for rank in LEARNERS:
        lines = [
            line for line in stderr.splitlines() if line.startswith(f"[rank {rank} ") and "stopping:" in line
        ]
        assert lines and reason in lines[0], stderr[-3000:]
    assert '/learner.py", line' not in stderr, stderr[-3000:]
    assert processes_of(run_dir) == {}, "no rank may outlive the run"
    assert not any(alive(pid) for pid in workers), "no worker may outlive the run"


@pytest.mark.slow
def test_ranks_listen_on_loopback_only_and_a_killed_launcher_takes_them_along(tmp_path):
    run_dir, rpc_port = tmp_path / "run", free_port()
    command = fabric_command(DEVICES, "train.py", f"rpc.port={rpc_port}", *LONG_RUN, f"run_dir={run_dir}")
    process = start(command, run_dir)
    ranks = {rank: pid for pid, rank in processes_of(run_dir).items() if rank is not None}
    assert sorted(ranks) == [0, 1, 2]
    # Training, so every process has its gloo or TensorPipe listeners up, and rank 0 serves
    # RPC's rendezvous and the watchdog's store: none of them may listen beyond loopback.
    # (The c10d store on the main port is the launcher's, under `fabric run`.)
    sockets = {rank: listening(pid) for rank, pid in ranks.items()}
    assert all(sockets.values()), sockets
    assert {rpc_port, rpc_port + 1} <= {port for found in sockets.values() for _, port in found}
    for rank, found in sockets.items():
        exposed = [f"{host}:{port}" for host, port in found if not ipaddress.ip_address(host).is_loopback]
        assert not exposed, f"rank {rank} listens beyond loopback: {exposed}"
    if REPLAY_RECIPE is not None:
        # The replay process is rank 0's child and sees no GPU: on a GPU node every GPU trains.
        assert parent_of(ranks[2]) == ranks[0]
        assert environment_of(ranks[2])["CUDA_VISIBLE_DEVICES"] == ""

    # What the OOM killer or a scheduler's hard kill does: the launcher alone, no warning.
    os.kill(process.pid, signal.SIGKILL)
    process.wait()

    deadline = time.monotonic() + 60
    while processes_of(run_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = processes_of(run_dir)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == {}, "ranks outlived their launcher by 60 s"
    # The ranks wrote to the launcher's stderr pipe, which stays readable once they are gone.
    # (Rank 0 kills the replay process as it goes.)
    stderr = process.stderr.read()
    for rank in LEARNERS:
        lines = [line for line in stderr.splitlines() if line.startswith(f"[rank {rank} ")]
        assert any(f"the launcher is gone (pid {process.pid})" in line for line in lines), stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("to", ["every process", "one learner"])
def test_a_stop_signal_stops_all_ranks_cleanly_and_keeps_the_records(tmp_path, to):
    """Ranks that Fabric started itself, collecting in the background where the recipe
    replays (a sync run stopped by Ctrl-C under `fabric run` is test_checkpoint.py's).
    Ctrl-C signals every process of the terminal's group; a scheduler or a user's kill may
    signal one learner alone, which tells the others: every learner then stops at the same
    step and writes its part of the checkpoint, whatever step the others heard of it at."""
    mode = "sync" if REPLAY_RECIPE is None else "async"
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "train.py",
        f"fabric.devices={DEVICES}",
        "fabric.accelerator=cpu",
        f"collector.mode={mode}",
    ]
    # checkpoint.every at its default (none): the stop writes one.
    run = [*command, *LONG_RUN, f"run_dir={run_dir}"]
    process = start(run, run_dir, fabric_launcher_env())
    if to == "every process":
        os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C does: every process of the terminal's group
    else:
        (learner,) = [pid for pid, rank in processes_of(run_dir).items() if rank == 1]
        os.kill(learner, signal.SIGINT)

    code, stderr, seconds = finish(process, timeout=90)
    assert code == 128 + signal.SIGINT, stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGINT"
    assert 0 < summary["frames_collected"] < 10_000_000
    assert len(set(summary["learner_param_checksums"].values())) == 1
    # A stop plays no final greedy episodes: they could outlast the 30 s a launcher allows.
    assert (summary["eval_return"], summary["eval_episodes"]) == (None, 0)
    assert (run_dir / "checkpoints" / "final.pt").is_file()
    assert checkpoint.Meta.read(checkpoint.latest(run_dir)).frames == summary["frames_collected"]
    if REPLAY_RECIPE is not None:
        # Every frame counted is in replay, once: none was in flight, none went missing.
        assert summary["replay_size"] == summary["frames_collected"]
    assert processes_of(run_dir) == {}


@pytest.mark.slow
def test_a_non_finite_loss_stops_the_run_and_says_where(tmp_path):
    run_dir = tmp_path / "run"
    # A discount that is not a number: no recipe's loss can be finite with it.
    overrides = [*tiny_overrides(RECIPE), "algo.gamma=nan", "rpc.heartbeat_timeout=5", f"run_dir={run_dir}"]
    process = launch(fabric_command(DEVICES, "train.py", *overrides))
    code, stderr, _ = finish(process, timeout=120)
    assert code != 0
    reports = [line for line in stderr.splitlines() if "stopping:" in line]
    # Every learner says so: those that saw it, and the others. (A learner may say it twice,
    # when another learner's report reaches it while it reports its own; the replay process
    # says it too, unless rank 0 has killed it first.)
    assert {str(rank) for rank in LEARNERS} <= {line.split(" ")[1] for line in reports}, stderr[-3000:]
    assert all("(learner) failed: non-finite loss" in line and "at frame" in line for line in reports)
    assert processes_of(run_dir) == {}


BROKEN_ENV = "env.id=tests.raising_env:BrokenCartPole-v1"
DISCRETE = [name for name in RECIPES if "discrete" in recipes.load(name).Agent.action_spaces]
DISCRETE_REPLAY = [name for name in DISCRETE if recipes.load(name).Agent.uses_replay]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fail_in", "mode"),
    [("step", "sync"), ("reset", "sync"), pytest.param("step", "async", marks=pytest.mark.skipif(
        not DISCRETE_REPLAY, reason="async collection is for replay recipes"))],
)  # fmt: skip
def test_an_environment_that_raises_stops_the_run_in_one_line_with_its_traceback_in_the_log(
    tmp_path, fail_in, mode
):
    recipe = (DISCRETE_REPLAY if mode == "async" else DISCRETE)[0]
    overrides = [
        *tiny_overrides(recipe),
        BROKEN_ENV,
        f"env.kwargs.fail_in={fail_in}",
        f"collector.mode={mode}",
    ]
    result = run_command([sys.executable, "train.py", *overrides, f"run_dir={tmp_path / 'run'}"])
    assert result.returncode == 1
    reports = [line for line in result.stderr.splitlines() if "stopping:" in line]
    assert len(reports) == 1, result.stderr[-3000:]
    env_id = BROKEN_ENV.removeprefix("env.id=")
    if mode == "sync":
        error = f"ValueError: the environment broke in {fail_in}"
        reason = f"rank 0 (learner) failed: collecting from {env_id}: {error}"
        assert reports[0].endswith(reason), reports[0]
        assert f"ERROR {collecting.__module__}: collecting from {env_id} failed" in result.stderr
    else:  # the child dies of it, and says why before it goes
        process = f"the collector process of rank 0 (learner), collecting from {env_id}, died"
        reason = f"rank 0 (learner) failed: {process}"
        assert reason in reports[0], reports[0]
    assert (
        "Traceback" in result.stderr
        and f'raise ValueError("the environment broke in {fail_in}")' in result.stderr
    )
