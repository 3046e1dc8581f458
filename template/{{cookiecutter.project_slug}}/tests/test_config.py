"""Configuration: overrides reach every key, bad input is one clear line and exit code 2."""

from __future__ import annotations

import dataclasses
import os
import re
import sys

import pytest
from omegaconf import OmegaConf

from {{ cookiecutter.package_name }} import config, recipes, train, usage
from {{ cookiecutter.package_name }}.distributed.topology import Topology, cpus_per_rank

from .conftest import REPLAY_RECIPE, needs_replay, run_command


def test_overrides_reach_nested_and_recipe_keys():
    cfg = config.load(["env.num_envs=4", "algo.lr=0.01", "replay.capacity=500", "seed=3"], train.DEFAULTS)
    assert (cfg.env.num_envs, cfg.algo.lr, cfg.replay.capacity, cfg.seed) == (4, 0.01, 500, 3)
    assert cfg.run_dir == f"runs/{cfg.recipe}-{cfg.env.id}-seed3"


def test_an_env_id_with_a_slash_names_one_run_folder():
    pytest.importorskip("minatar", reason="needs the [minatar] extra")
    cfg = config.load(["env.id=MinAtar/Breakout-v1", "seed=2"], train.DEFAULTS)
    assert cfg.run_dir == f"runs/{cfg.recipe}-MinAtar-Breakout-v1-seed2"


# Classic-control envs of each kind of action space, and one of the other kind.
ANOTHER_ENV = {"discrete": "Acrobot-v1", "continuous": "MountainCarContinuous-v0"}
WRONG_ENV = {"discrete": ("Pendulum-v1", "continuous actions (1 dimension)"),
             "continuous": ("CartPole-v1", "2 discrete actions")}  # fmt: skip
# An env id of each family, for the recipes' FAMILY_DEFAULTS.
FAMILY_ENVS = {
    "atari": "ALE/Pong-v5",
    "minatar": "MinAtar/Breakout-v1",
    "mujoco": "Hopper-v5",
    "popgym": "popgym-PositionOnlyCartPoleEasy-v0",
}
FAMILY_MODULES = {"atari": "ale_py", "minatar": "minatar", "mujoco": "mujoco", "popgym": "popgym"}


@pytest.mark.parametrize("recipe", recipes.available())
def test_each_recipe_brings_its_run_defaults_and_the_command_line_wins(recipe):
    module = recipes.load(recipe)
    defaults = module.RUN_DEFAULTS
    cfg = config.load([f"recipe={recipe}"], train.DEFAULTS)
    assert (cfg.env.id, cfg.total_frames) == (defaults["env"]["id"], defaults["total_frames"])
    assert cfg.collector.frames_per_batch == defaults["collector"]["frames_per_batch"]
    # config.yaml's: every 10,000 frames, or 20 times a long run.
    assert cfg.eval.every == max(10_000, defaults["total_frames"] // 20)
    other = ANOTHER_ENV[module.Agent.action_spaces[0]]
    cfg = config.load([f"recipe={recipe}", f"env.id={other}", "total_frames=10000000"], train.DEFAULTS)
    assert (cfg.env.id, cfg.total_frames, cfg.eval.every) == (other, 10_000_000, 500_000)
    cfg = config.load([f"recipe={recipe}", "total_frames=77", "eval.every=50"], train.DEFAULTS)
    assert (cfg.total_frames, cfg.eval.every) == (77, 50)


@pytest.mark.parametrize("recipe", recipes.available())
def test_an_env_with_actions_the_recipe_does_not_fit_is_one_error_line(capsys, recipe):
    spaces = recipes.load(recipe).Agent.action_spaces
    if len(spaces) > 1:
        pytest.skip(f"{recipe} fits both kinds of action spaces")
    env_id, actions = WRONG_ENV[spaces[0]]
    assert train.main([f"recipe={recipe}", f"env.id={env_id}", "--print-config"]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: recipe {recipe} needs {spaces[0]} actions; {env_id} has {actions}\n"
    assert captured.out == ""


@pytest.mark.parametrize("recipe", recipes.available())
def test_print_config_says_where_each_value_came_from(capsys, recipe):
    module = recipes.load(recipe)
    field = dataclasses.fields(module.Config)[0].name  # left at the Config's default below
    assert train.main([f"recipe={recipe}", "seed=5", "--print-config"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"recipe: {recipe}  # command line" in lines and "seed: 5  # command line" in lines
    assert "log_every: 5000" in lines  # config.yaml's: no comment
    assert f"total_frames: {module.RUN_DEFAULTS['total_frames']}  # {recipe}" in lines
    assert "  batches_per_request: 4  # default in config.py" in lines
    assert any(line.startswith(f"  {field}:") and line.endswith(f"# {recipe} Config") for line in lines)
    for family, defaults in getattr(module, "FAMILY_DEFAULTS", {}).items():
        pytest.importorskip(FAMILY_MODULES[family])
        assert train.main([f"recipe={recipe}", f"env.id={FAMILY_ENVS[family]}", "--print-config"]) == 0
        lines = capsys.readouterr().out.splitlines()
        if "collector" in defaults:
            frames = defaults["collector"]["frames_per_batch"]
            assert f"  frames_per_batch: {frames}  # {recipe}, {family} family" in lines
        else:  # a family that sets hyperparameters only
            key, value = next(iter(defaults["algo"].items()))
            assert f"  {key}: {str(value).lower()}  # {recipe}, {family} family" in lines
        assert f"  id: {FAMILY_ENVS[family]}  # command line" in lines


@pytest.mark.parametrize("recipe", recipes.available())
def test_a_recipe_sets_only_what_config_yaml_leaves_to_it(recipe):
    """config.yaml sits over a recipe's run and family defaults: a value it sets hides theirs."""
    file = OmegaConf.load(train.DEFAULTS)
    module = recipes.load(recipe)
    for defaults in [module.RUN_DEFAULTS, *getattr(module, "FAMILY_DEFAULTS", {}).values()]:
        for key in flat_keys(defaults):
            parent, _, leaf = key.rpartition(".")
            section = OmegaConf.select(file, parent) if parent else file
            assert section is None or leaf not in section or OmegaConf.is_missing(section, leaf), key


def test_print_config_shows_resolved_values_without_running(capsys, tmp_path):
    assert train.main(["--print-config", "total_frames=123", f"run_dir={tmp_path}/run"]) == 0
    out = capsys.readouterr().out
    assert "total_frames: 123" in out and "lr:" in out
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("recipe", recipes.available())
def test_help_lists_every_key_with_its_value_and_a_description(capsys, monkeypatch, recipe):
    monkeypatch.setenv("COLUMNS", "100")
    assert train.main([f"recipe={recipe}", "seed=7", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python train.py")
    too_long = [line for line in out.splitlines() if len(line) > 100]
    assert not too_long, too_long
    rows = help_rows(out)
    cfg = config.load([f"recipe={recipe}", "seed=7"], train.DEFAULTS)
    keys = flat_keys(OmegaConf.to_container(cfg))
    assert "env.kwargs" in keys and rows["env.kwargs"][0] == "{}"
    assert sorted(rows) == sorted(keys)
    assert rows["seed"][0] == "7"  # the resolved values, overrides included
    assert rows["env.id"][0] == cfg.env.id  # a value the recipe sets
    for key, (_, description) in rows.items():
        assert description, f"{key} has no description"
    # A comment that goes on over the next line (config.yaml's) is read whole.
    assert rows["collector.sync_frac"][1].endswith("1: everyone collects in full")
    fields = [field.name for field in dataclasses.fields(recipes.load(recipe).Config)]
    assert [key for key in keys if key.startswith("algo.")] == [f"algo.{name}" for name in fields]


def help_rows(out: str) -> dict[str, tuple[str, str]]:
    """key -> (value, description) of --help's rows: ``  key=value  description``, the
    description going on over the indented lines below."""
    rows, last = {}, None
    for line in out.splitlines():
        if match := re.match(r"^  (\S+?)=(\S*)\s*(.*)$", line):
            last = match[1]
            rows[last] = (match[2], match[3])
        elif last and line.startswith(" " * usage.DESCRIPTION_COLUMN):
            value, description = rows[last]
            rows[last] = (value, f"{description} {line.strip()}".strip())
        else:
            last = None
    return rows


def flat_keys(tree: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in tree.items():
        nested = isinstance(value, dict) and value  # an empty dict (env.kwargs) is a key of its own
        keys += flat_keys(value, f"{prefix}{key}.") if nested else [f"{prefix}{key}"]
    return keys


def test_help_with_bad_input_is_one_error_line(capsys):
    assert train.main(["recipe=nosuch", "--help"]) == 2
    assert (
        capsys.readouterr().err.strip()
        == "error: unknown recipe 'nosuch' (available: " + ", ".join(recipes.available()) + ")"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["env.id=NoSuchEnv-v0"], "unknown env id 'NoSuchEnv-v0'"),
        (["recipe=nosuch"], "unknown recipe 'nosuch'"),
        (["no_such_key=1"], "unknown config key 'no_such_key'"),
        (["algo.no_such_key=1"], "unknown config key 'algo.no_such_key'"),
        (["total_frames=0"], "total_frames must be > 0"),
        (["total_frames=-5"], "total_frames must be > 0"),
        (["total_frames=lots"], "total_frames: Value 'lots'"),
        pytest.param(
            [f"recipe={REPLAY_RECIPE}", "fabric.devices=2", "replay.processes=0"],
            "replay.processes must be >= 1 for a replay recipe on several learners",
            marks=needs_replay,
        ),
        (["replay.batches_per_request=0"], "replay.batches_per_request must be >= 1, got 0"),
        (["replay.alpha=-0.5"], "replay.alpha must be >= 0 (0: uniform), got -0.5"),
        (["replay.storage=disk"], "replay.storage must be memory or memmap, got 'disk'"),
        (["fabric.precision=16-mixed"], "fabric.precision must be 32-true or bf16-mixed, got '16-mixed'"),
        (["eval.episodes=-1"], "eval.episodes must be >= 0 (0: no evaluation), got -1"),
        (["eval.every=-5"], "eval.every must be >= 0 (0: only at the end), got -5"),
        (["rpc.heartbeat_timeout=0"], "rpc.heartbeat_timeout must be > 0, got 0"),
        (["rpc.timeout=-1"], "rpc.timeout must be > 0, got -1"),
        (["learners.timeout=0"], "learners.timeout must be > 0, got 0"),
        (["learners.batch_size_of=each"], "learners.batch_size_of must be run or learner, got 'each'"),
        (["env.frame_stack=1"], "env.frame_stack is for Atari games (CartPole-v1 is not one)"),
        (["env.threads=0"], "env.threads must be >= 1 (null: the rank's share), got 0"),
        (["threads=-1"], "threads must be >= 1 (null: the rank's share of the cores), got -1"),
        (["collector.frames_per_batch=0"], "collector.frames_per_batch must be > 0, got 0"),
        (
            ["learners.share_gpu=true", "fabric.accelerator=cpu"],
            "learners.share_gpu=true puts the learners on a GPU; fabric.accelerator is cpu",
        ),
        (["collector.policy_device=gpu"], "collector.policy_device must be learner, cpu or auto, got 'gpu'"),
        (["loggers=[csv,neptune]"], "unknown logger 'neptune' in loggers (choose from csv, tensorboard"),
        (["collector.frames_per_batch=100", "env.num_envs=8"], "must be a multiple of env.num_envs"),
        pytest.param(
            [f"recipe={REPLAY_RECIPE}", "replay.capacity=10"], "exceeds replay.capacity", marks=needs_replay
        ),
        (["total_frames"], "expected key=value"),
    ],
)
def test_bad_input_is_one_error_line(capsys, argv, message):
    # --print-config: should a check ever let bad input through, the test fails at once
    # instead of starting a training run.
    assert train.main([*argv, "--print-config"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("error: ") and message in lines[0], lines[0]
    assert captured.out == ""


def test_cudagraphs_off_a_cuda_device_is_one_error_line(tmp_path):
    """The learners' device is Fabric's choice, known once Fabric is made: the check comes
    after it, before any rank starts."""
    command = [sys.executable, "train.py", "cudagraphs=true", "fabric.accelerator=cpu", f"run_dir={tmp_path}"]
    result = run_command(command, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: cudagraphs=true needs a CUDA device; the learners run on cpu"
    assert not (tmp_path / "summary.json").exists()


def test_fabric_settings_lightning_refuses_are_one_error_line(tmp_path):
    """Fabric checks its own settings when it is made (fabric.accelerator=cuda on a machine
    without a GPU is refused the same way): Lightning's reason, in one line."""
    command = [sys.executable, "train.py", "fabric.accelerator=bogus", f"run_dir={tmp_path}"]
    result = run_command(command, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    # Lightning lists the accelerator names in an order of its own: the line up to them.
    refusal = "error: Fabric refuses the fabric settings: "
    assert len(lines) == 1, lines
    assert lines[0].startswith(refusal + "You selected an invalid accelerator name: `accelerator='bogus'`")
    assert not (tmp_path / "summary.json").exists()


@needs_replay
def test_a_batch_too_small_to_deal_out_over_the_learners_is_one_error_line(tmp_path):
    """learners.batch_size_of=run deals each update's batch out over the learners, a transition at
    least for each: known once Fabric knows how many learners there are."""
    command = [sys.executable, "train.py", f"recipe={REPLAY_RECIPE}", "algo.batch_size=1"]
    command += ["fabric.accelerator=cpu", "fabric.devices=2", f"run_dir={tmp_path}"]
    result = run_command(command, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: algo.batch_size (1) is dealt out over the learners (learners.batch_size_of=run): "
        "it needs at least one transition for each of the 2"
    )
    assert not (tmp_path / "summary.json").exists()


def test_every_rank_is_a_learner_and_replay_processes_come_after():
    plan = Topology.plan(learners=2, rank=0, replay_ranks=1, uses_replay=True)
    assert plan.roles == {"0": "learner", "1": "learner", "2": "replay"}
    assert plan.learner_ranks == (0, 1) and plan.shard_ranks == (2,) and plan.world_size == 3
    on_policy = Topology.plan(learners=2, rank=1, replay_ranks=1, uses_replay=False)
    assert on_policy.roles == {"0": "learner", "1": "learner"} and on_policy.learner_index == 1
    single = Topology.plan(learners=1, rank=0, replay_ranks=1, uses_replay=True)
    assert single.roles == {"0": "learner"} and single.shard_ranks == (0,)


SLURM = {"SLURM_NTASKS": "4", "SLURM_JOB_NAME": "train", "SLURM_CPUS_PER_TASK": "3"}


def test_threads_per_rank_come_from_the_cores_this_process_may_use(monkeypatch):
    for key in [key for key in os.environ if key.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    cores = os.sched_getaffinity(0)
    assert (cpus_per_rank(1), cpus_per_rank(2)) == (len(cores), max(1, len(cores) // 2))
    # The machine's cores are not the allocation: what `taskset -c 0` does, one core of them.
    os.sched_setaffinity(0, {min(cores)})
    try:
        assert (cpus_per_rank(1), cpus_per_rank(2)) == (1, 1)
    finally:
        os.sched_setaffinity(0, cores)
    # Under srun each rank is a task with SLURM_CPUS_PER_TASK cores of its own.
    for key, value in SLURM.items():
        monkeypatch.setenv(key, value)
    assert (cpus_per_rank(1), cpus_per_rank(2)) == (3, 3)
    # Under slurm.sh the task is a torchrun agent: its node's ranks share the task's cores.
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "8")
    for key in ("TORCHELASTIC_RUN_ID", "RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(key, "0")
    assert (cpus_per_rank(1), cpus_per_rank(2), cpus_per_rank(16)) == (8, 4, 1)
