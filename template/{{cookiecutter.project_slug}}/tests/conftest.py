"""Shared helpers: run train.py the way a user would and read what it left behind."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict
from torchrl.collectors import Collector

from {{ cookiecutter.package_name }} import recipes
from {{ cookiecutter.package_name }}.envs import make_env
from {{ cookiecutter.package_name }}.replay import ReplayShard
from {{ cookiecutter.package_name }}.replay.frames import NEXT_OBSERVATION, OBSERVATION

PROJECT = Path(__file__).resolve().parents[1]
# Two test modules run at a time, each with runs of their own: a process that spreads its
# small tensor ops over every core only waits for busy cores (about twice the CPU time of
# a tiny one-process run, measured with /usr/bin/time under `pytest -n 2`).
torch.set_num_threads(1)
# `pytest -n 2 --dist loadscope` runs a module at a time on each worker, in collection order:
# the modules that take longest on 2 cores go first, so that the last ones to start are
# short and neither worker waits long for the other at the end (a SLURM job's time limit
# alone takes minutes). pytest-xdist would otherwise start the modules with most tests first.
LONGEST_FIRST = ["test_train.py", "test_faults.py", "test_benchmarks.py", "test_slurm.py"]
LONGEST_FIRST += ["test_checkpoint.py", "test_restarts.py", "test_ppo.py", "test_adding_a_recipe.py"]
LONGEST_FIRST += ["test_r2d2.py", "test_elastic.py", "test_stragglers.py"]


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def start(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=start)  # stable: each module's tests keep their order
    if not torch.cuda.is_available():
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


RECIPES = recipes.available()
REPLAY_RECIPES = [name for name in RECIPES if recipes.load(name).Agent.uses_replay]


def replays_sequences(recipe: str) -> bool:
    """Whether ``recipe``'s replay items are sequences (its Config has a ``sequence_length``)."""
    return "sequence_length" in {field.name for field in dataclasses.fields(recipes.load(recipe).Config)}


# The runtime's replay tests run with the first replay recipe whose items are transitions
# (they build transitions by hand, and count one item per frame); a project generated
# without one has no such path to test (a sequence recipe's runs are in its own tests).
TRANSITION_RECIPES = [name for name in REPLAY_RECIPES if not replays_sequences(name)]
REPLAY_RECIPE = TRANSITION_RECIPES[0] if TRANSITION_RECIPES else None
NO_REPLAY = "this project has no transition replay recipe"
needs_replay = pytest.mark.skipif(REPLAY_RECIPE is None, reason=NO_REPLAY)
# The recipe that the tests of faults, restarts, SLURM and checkpointed runs train: the
# first transition replay recipe, else the first on-policy one (their counts assume either).
RUNTIME_RECIPE = REPLAY_RECIPE or next((name for name in RECIPES if name not in REPLAY_RECIPES), None)
needs_runtime_recipe = pytest.mark.skipif(RUNTIME_RECIPE is None, reason="all recipes replay sequences")

# Tiny settings: enough steps to exercise collection, replay, updates and evaluation.
TINY = [
    "total_frames=3072",
    "env.num_envs=8",
    "collector.frames_per_batch=256",
    "log_every=1024",
    "eval.every=2048",
    "eval.episodes=10",
    # On-policy learners in lockstep: these tests count frames and updates exactly
    # (test_stragglers.py runs the threshold that cuts rollouts short).
    "collector.sync_frac=1",
    # One core per process, as for the test process itself (below).
    "threads=1",
]
# Tiny hyperparameters, for the recipes that have them.
TINY_ALGO = {
    "hidden_sizes": "[32,32]",
    "learning_starts": 1024,
    "updates_per_batch": 4,
    "epochs": 2,
    "minibatch_size": 128,
}


def expected_updates(recipe: str, learners: int, frames: int = 3072) -> int:
    """Updates per learner of a TINY run of ``frames`` (whole steps of 256 frames per learner)."""
    steps = frames // (256 * learners)
    if recipes.load(recipe).Agent.uses_replay:
        # 4 updates per step and learner (learners.batch_size_of=run: the run's 4 per 256 frames)
        # once 1024 frames (all learners together) are in.
        return 4 * learners * sum(1 for step in range(1, steps + 1) if step * 256 * learners >= 1024)
    return steps * 2 * (256 // 128)  # 2 epochs of 128-frame minibatches


def replay_items(recipe: str, frames: int, learners: int = 1, num_envs: int = 8) -> int:
    """The items in replay after a run of ``frames`` (whole collector steps, nothing
    overwritten): a transition per frame, or, for a recipe whose Config has a
    ``sequence_length`` and an ``overlap``, each env copy's sequences at their defaults."""
    if not replays_sequences(recipe):
        return frames
    defaults = {field.name: field.default for field in dataclasses.fields(recipes.load(recipe).Config)}
    length, stride = defaults["sequence_length"], defaults["sequence_length"] - defaults["overlap"]
    steps = frames // (num_envs * learners)  # each copy's
    return learners * num_envs * ((steps - length) // stride + 1 if steps >= length else 0)


def tiny_overrides(recipe: str) -> list[str]:
    fields = {field.name for field in dataclasses.fields(recipes.load(recipe).Config)}
    algo = [f"algo.{key}={value}" for key, value in TINY_ALGO.items() if key in fields]
    return [f"recipe={recipe}", *TINY, *algo]


_HANDED_OUT: set[int] = set()
# Ports below the kernel's ephemeral range: a port the kernel hands out to connections (the
# ranks' own connections to the launcher's store, say) could be taken between the check
# here and the run binding it.
_EPHEMERAL_LOW = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
_PORTS = random.Random(os.getpid())


def free_port() -> int:
    """A port P such that P and P + 1 are free and were not handed out before: a run given
    `rpc.port=P` also listens on P + 1 (the watchdog)."""
    while True:
        port = _PORTS.randrange(_EPHEMERAL_LOW // 2, _EPHEMERAL_LOW - 2)
        block = {port, port + 1}
        if block & _HANDED_OUT or not all(_bindable(p) for p in block):
            continue
        _HANDED_OUT.update(block)
        return port


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def command_env() -> dict[str, str]:
    # Scripts under benchmarks/ import the package as an installed project would.
    pythonpath = os.pathsep.join(filter(None, [str(PROJECT), os.environ.get("PYTHONPATH")]))
    # A process that crashes (SIGSEGV, SIGABRT) prints its threads' Python stacks.
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": pythonpath, "PYTHONFAULTHANDLER": "1"}


def run_command(
    command: list[str], timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, cwd=PROJECT, env=env or command_env(), capture_output=True, text=True, timeout=timeout
    )


def fabric_command(devices: int, *arguments: str, main_port: int | None = None) -> list[str]:
    """``fabric run`` on CPU with gloo; ``arguments`` are launcher options, then ``train.py``
    and its overrides. c10d and RPC get free ports unless given."""
    fabric = shutil.which("fabric", path=str(Path(sys.executable).parent)) or "fabric"
    launcher = ["run", "--accelerator", "cpu", "--strategy", "ddp", "--devices", str(devices)]
    launcher += ["--main-port", str(main_port or free_port())]
    return [fabric, *launcher, *arguments]


_LAUNCHED: list[subprocess.Popen] = []


def launch(command: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``command`` without waiting, in its own session (so that a signal can reach
    its whole process group), its output captured. It ends with the test at the latest."""
    process = subprocess.Popen(
        command,
        cwd=PROJECT,
        env=env or command_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    _LAUNCHED.append(process)
    return process


@pytest.fixture(autouse=True)
def no_run_outlives_its_test():
    """A test that fails while its run trains must not leave the run training (ranks that
    `fabric run` starts in sessions of their own follow their launcher within 60 s)."""
    yield
    while _LAUNCHED:
        process = _LAUNCHED.pop()
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()  # not its output: ranks outside the group may hold the pipes open


def learners_run(learners: int, *overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """A run of ``learners`` ranks that Fabric launches itself (`python train.py
    fabric.devices=N`): a process fewer than `fabric run`, whose launcher imports torch and
    Lightning as a rank does. The fault, checkpoint and straggler tests run `fabric run`."""
    command = [sys.executable, "train.py", f"fabric.devices={learners}", "fabric.accelerator=cpu"]
    return run_command([*command, "fabric.strategy=ddp", *overrides], timeout, fabric_launcher_env())


def fabric_launcher_env() -> dict[str, str]:
    """The environment for a run Fabric launches itself, with a free main port: Fabric's own
    choice is one the kernel picked and let go, which another test's connection may take
    before rank 0 binds it."""
    return {**command_env(), "MASTER_PORT": str(free_port())}


def processes_of(run_dir: Path) -> dict[int, int | None]:
    """pid -> rank of every process whose command line names ``run_dir``, or its config.yaml
    (a replay process; its rank is in RANK). The launcher's rank is None; srun's tasks are
    ranks by their SLURM_PROCID."""
    names = {f"run_dir={run_dir}", str(run_dir / "config.yaml")}
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            if not names & set((entry / "cmdline").read_text().split("\0")):
                continue
            environ = environment_of(int(entry.name))
        except (OSError, ValueError):
            continue
        rank = environ.get("RANK") or environ.get("LOCAL_RANK") or environ.get("SLURM_PROCID")
        found[int(entry.name)] = int(rank) if rank is not None else None
    return found


def environment_of(pid: int) -> dict[str, str]:
    """The environment process ``pid`` was started with."""
    items = (Path("/proc") / str(pid) / "environ").read_text().split("\0")
    return dict(item.split("=", 1) for item in items if "=" in item)


def failure_report(result: subprocess.CompletedProcess) -> str:
    """What a failed run said: the ranks' one-line reasons first (the launcher's traceback
    that follows them would push them out of a plain tail), then the output's tails, less
    the C++ stack frames torch prints with its store warnings once a rank has gone."""
    lines = result.stderr.splitlines()
    reasons = [line for line in lines if "stopping:" in line or "error:" in line]
    # A crash's own words: C++'s uncaught exception, and the stacks faulthandler printed.
    for start, line in enumerate(lines):
        if "terminate called" in line or "Fatal Python error" in line:
            reasons += lines[start : start + 40]
    stderr = "\n".join(line for line in lines if not re.match(r"\s*frame #\d+: ", line))
    return "\n".join([*reasons, result.stdout[-2000:], stderr[-2000:]])


def read_summary(result: subprocess.CompletedProcess) -> dict:
    """The summary named by the run's last printed line."""
    assert result.returncode == 0, failure_report(result)
    last_line = result.stdout.strip().splitlines()[-1]
    assert last_line.startswith("summary: "), last_line
    return json.loads(Path(last_line.removeprefix("summary: ")).read_text())


# A few hundred frames on two learners and a replay process, a checkpoint at the end
# to look into the replay shard. Atari games are cut at 800 emulator frames (200 steps).
SMALL = [
    "env.num_envs=4",
    "collector.frames_per_batch=32",
    "total_frames=384",
    "replay.capacity=1000",
    "algo.learning_starts=128",
    "algo.updates_per_batch=2",
    "algo.batch_size=8",
    "eval.episodes=2",
    "eval.every=0",
    "log_every=128",
    "checkpoint.every=384",
]
ATARI_SHORT = "env.kwargs.max_num_frames_per_episode=800"


def saved_shard(run_dir: Path) -> ReplayShard:
    """The run's (first) replay shard, as its checkpoint restores it."""
    (folder,) = (run_dir / "checkpoints").glob("frames-*")
    cfg = OmegaConf.load(run_dir / "config.yaml")
    shard = ReplayShard(cfg.replay.capacity, cfg.replay.alpha, cfg.replay.beta)
    shard.load(str(folder / "replay-0"))
    return shard


def replay_sample(run_dir: Path) -> dict:
    """Four items from the run's replay shard, as its checkpoint restores it."""
    batch, *_ = saved_shard(run_dir).sample(4)
    return batch


def family_run(tmp_path: Path, recipe: str, env_id: str, *extra: str) -> tuple[dict, dict]:
    result = learners_run(2, f"recipe={recipe}", f"env.id={env_id}", *SMALL, *extra, f"run_dir={tmp_path}")
    summary = read_summary(result)
    assert summary["roles"] == {"0": "learner", "1": "learner", "2": "replay"}
    assert summary["frames_collected"] == summary["replay_size"] == 384
    assert summary["updates"] > 0 and summary["eval_episodes"] == 2
    checksums = set(summary["learner_param_checksums"].values())
    assert len(checksums) == 1  # the learners stayed identical
    return summary, replay_sample(tmp_path)


def pendulum_agent_and_batch(recipe, batch_size: int = 32):
    """A continuous-action replay recipe's small agent on 4 copies of Pendulum, the 128
    frames its policy collected, and a prioritized batch of ``batch_size`` sampled from them."""
    torch.manual_seed(0)
    env = make_env("Pendulum-v1", num_envs=4, seed=0)
    agent = recipe.Agent(recipe.Config(hidden_sizes=[16], batch_size=batch_size), env)
    frames = collect_one_batch(env, agent.policy, 128).reshape(-1)
    shard = ReplayShard(1000, alpha=0.6, beta=0.4)
    shard.extend(frames.select(*agent.batch_keys))
    batch, _, _ = shard.sample(batch_size)
    return agent, frames, batch


def one_learner(values: torch.Tensor) -> torch.Tensor:
    """``sum_over_learners`` in a run of one learner: the values themselves."""
    return values


def collect_one_batch(env, policy, frames: int):
    """One batch of ``frames`` from torchrl's Collector, as the learner's sync mode collects it."""
    collector = Collector(
        env, policy, frames_per_batch=frames, total_frames=frames, track_traj_ids=False,
        auto_register_policy_transforms=False,
    )  # fmt: skip
    batch = next(iter(collector))
    collector.shutdown()
    return batch


STEP_ID = "step_id"  # numbers the transitions a replay test collected


def pong_batches(envs: int = 2, steps: int = 20, batches: int = 4) -> list[TensorDict]:
    """Collector batches ``[env copies, steps]`` of Pong from the env training steps
    (ale-py's preprocessing: 84x84 grey, 4-frame stack), episodes of about 25 steps,
    each transition numbered by ``STEP_ID``."""
    pytest.importorskip("ale_py", reason="needs the [atari] extra")
    env = make_env({"id": "ALE/Pong-v5", "kwargs": {"max_num_frames_per_episode": 100}}, envs, seed=0)
    batch = collect_one_batch(env, None, envs * steps * batches)  # time runs along dim 1
    env.close()
    keys = [("next", "reward"), ("next", "done"), ("next", "terminated")]
    batch = batch.select(OBSERVATION, "action", NEXT_OBSERVATION, *keys)
    batch[STEP_ID] = torch.arange(batch.numel()).view(batch.shape)
    return list(batch.split(steps, dim=1))


@pytest.fixture
def tiny() -> list[str]:
    """Tiny overrides for the runtime's replay tests (skipped without a replay recipe)."""
    if REPLAY_RECIPE is None:
        pytest.skip(NO_REPLAY)
    return tiny_overrides(REPLAY_RECIPE)
