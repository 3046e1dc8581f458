"""DD-PPO's straggler threshold on real ranks: a slow learner's rollouts are cut, frames
add up, the learners stay identical, a dead learner stops the run; and the arithmetic of
the minibatches of learners whose rollouts differ."""

from __future__ import annotations

import csv
import os
import signal

import pytest

from {{ cookiecutter.package_name }} import checkpoint, config, recipes, train
from {{ cookiecutter.package_name }}.distributed.stragglers import chunk_steps, minibatches, sequence_minibatches

from .conftest import (
    RECIPES,
    fabric_command,
    processes_of,
    read_summary,
    run_command,
    tiny_overrides,
)
from .test_faults import failed_within_60_s, start

ON_POLICY = [name for name in RECIPES if not recipes.load(name).Agent.uses_replay]
needs_on_policy = pytest.mark.skipif(not ON_POLICY, reason="this project has no on-policy recipe")
# CartPole whose steps sleep STRAGGLER_STEP_S on the rank named by STRAGGLER_RANK, and no
# time on the others (benchmarks/stragglers.py); gymnasium imports the module before the colon.
STRAGGLER_ENV = "env.id=benchmarks.stragglers:StragglerCartPole-v1"
SLOW_RANK = 2
# 4 ms a frame: a 256-frame rollout takes the straggler over a second, the others a fraction.
DELAY_S = 0.004


@pytest.fixture
def straggler(monkeypatch):
    """Runs started from this test have a straggler: the ranks inherit these variables."""
    monkeypatch.setenv("STRAGGLER_RANK", str(SLOW_RANK))
    monkeypatch.setenv("STRAGGLER_STEP_S", str(DELAY_S))


def straggler_run(*overrides: str, recipe: str | None = None) -> list[str]:
    recipe = recipe or ON_POLICY[0]
    return fabric_command(3, "train.py", *tiny_overrides(recipe), STRAGGLER_ENV, *overrides)


def last_step(run_dir) -> int:
    with (run_dir / "metrics.csv").open(newline="") as file:
        return max(int(row["step"]) for row in csv.DictReader(file))


def test_equal_rollouts_train_as_before():
    # 3 learners x 256 frames in minibatches of 128: 2 per epoch, each of weight exactly 1.
    assert minibatches([256, 256, 256], 1, 128) == [(128, 1.0), (128, 1.0)]


def test_every_frame_weighs_the_same_whoever_collected_it():
    sizes = [256, 256, 96]
    plans = [minibatches(sizes, index, 128) for index in range(3)]
    assert {len(plan) for plan in plans} == {2}  # the same number of updates everywhere
    for index, plan in enumerate(plans):
        assert sum(frames for frames, _ in plan) == sizes[index]  # every frame used once an epoch
    for j in range(2):
        frames = [plan[j][0] for plan in plans]
        weights = [plan[j][1] for plan in plans]
        # DDP averages the learners' gradients of their mean losses: the weights make that
        # the mean over all frames of the minibatch (each learner's share is frames / total).
        assert sum(weights) == pytest.approx(3.0)
        for own, weight in zip(frames, weights, strict=True):
            assert weight / 3 == pytest.approx(own / sum(frames))


def test_no_learner_gets_an_empty_minibatch():
    assert [frames for frames, _ in minibatches([512, 8, 512], 1, 16)] == [1] * 8


def test_recurrent_minibatches_hold_whole_sequences_and_weigh_every_frame_the_same():
    # 8 copies of 32 steps per learner in minibatches of about 128 frames: 2 parts of 4 copies.
    assert sequence_minibatches([256, 256, 256], 1, 8, 128) == [(4, 1.0), (4, 1.0)]
    # A cut learner has 8 shorter sequences: the same parts of copies everywhere, each
    # learner's weight its frames' share of all (DDP averages: every frame counts once).
    sizes = [256, 256, 64]
    plans = [sequence_minibatches(sizes, index, 8, 64) for index in range(3)]
    assert [[copies for copies, _ in plan] for plan in plans] == [[3, 3, 2]] * 3
    for j in range(3):
        frames = [plan[j][0] * size / 8 for plan, size in zip(plans, sizes, strict=True)]
        for own, (_, weight) in zip(frames, (plan[j] for plan in plans), strict=True):
            assert weight / 3 == pytest.approx(own / sum(frames))
    assert sequence_minibatches([512, 512], 0, 2, 16) == [(1, 1.0), (1, 1.0)]  # at least a copy each


def test_chunks_divide_the_rollout():
    assert [chunk_steps(steps) for steps in (32, 8, 4, 33, 37, 100)] == [4, 1, 1, 3, 1, 10]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("collector.sync_frac=0", "collector.sync_frac must be in (0, 1], got 0"),
        ("collector.min_rollout_frac=1.5", "collector.min_rollout_frac must be in (0, 1], got 1.5"),
        ("env.id=no_such_module:CartPole-v1", "env.id 'no_such_module:CartPole-v1': cannot import module"),
    ],
)
def test_bad_threshold_settings_are_one_error_line(override, message):
    with pytest.raises(config.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config.load([override], train.DEFAULTS)


@pytest.mark.slow
@pytest.mark.skipif("ppo" not in RECIPES, reason="this project has no ppo recipe")
def test_a_slow_recurrent_learner_is_cut_short_the_frames_add_up_and_the_run_resumes(tmp_path, straggler):
    """Recurrent PPO, whose rollouts are its copies' sequences as long as their chunks, the
    LSTM's state carried from chunk to chunk by the collector: the threshold cuts a
    learner's sequences as it cuts plain rollouts (benchmarks/stragglers.py's test cuts
    those on real ranks; the minibatches of both are tested above)."""
    first = ["algo.recurrent=true", "collector.sync_frac=0.6", "checkpoint.every=1024", f"run_dir={tmp_path}"]
    summary = read_summary(run_command(straggler_run(*first, "total_frames=1536", recipe="ppo")))
    rollouts = summary["learner_rollouts"]
    slow, fast = rollouts[str(SLOW_RANK)], [rollouts[rank] for rank in ("0", "1")]
    assert slow["cut"] > 0 and 0.25 <= slow["mean_fraction"] < 1, rollouts
    assert all(row["rollouts"] == slow["rollouts"] for row in fast)  # the same steps everywhere
    # Frames as collected: every learner's, exactly; the run ends at the first step past
    # total_frames (1536), and the records agree.
    frames = summary["frames_collected"]
    assert frames == sum(row["frames"] for row in rollouts.values())
    assert 1536 <= frames < 1536 + 3 * 256
    assert last_step(tmp_path) == frames
    assert summary["updates"] % 2 == 0  # 2 epochs of the same number of minibatches
    assert len(set(summary["learner_param_checksums"].values())) == 1  # the learners stayed identical

    last = checkpoint.latest(tmp_path)
    saved = checkpoint.Meta.read(last).frames
    assert 1024 <= saved < 1536 + 3 * 256
    # Resumed with two collector processes per learner (collector.workers=2): the threshold
    # cuts their rollouts as it cuts one process's.
    resumed = [*first, "total_frames=3072", "collector.workers=2", f"resume={tmp_path}"]
    summary = read_summary(run_command(straggler_run(*resumed, recipe="ppo")))
    assert summary["resumed_from"] == str(last)
    # The frames counted on from the checkpoint's exact count, each learner's own this time.
    assert summary["learner_rollouts"][str(SLOW_RANK)]["cut"] > 0
    rollouts = summary["learner_rollouts"].values()
    assert summary["frames_collected"] == saved + sum(row["frames"] for row in rollouts) >= 3072
    assert last_step(tmp_path) == summary["frames_collected"]
    assert len(set(summary["learner_param_checksums"].values())) == 1


@pytest.mark.slow
@needs_on_policy
@pytest.mark.parametrize("victim", [0, SLOW_RANK], ids=["store-host", "straggler"])
def test_a_dead_learner_stops_the_others_while_they_count_rollouts(tmp_path, straggler, victim):
    run_dir = tmp_path / "run"
    overrides = ["collector.sync_frac=0.6", "total_frames=10000000", "rpc.heartbeat_timeout=5"]
    process = start(straggler_run(*overrides, f"run_dir={run_dir}"), run_dir)
    ranks = {rank: pid for pid, rank in processes_of(run_dir).items() if rank is not None}
    os.kill(ranks[victim], signal.SIGKILL)
    stderr = failed_within_60_s(process)
    for rank in (rank for rank in ranks if rank != victim):
        lines = [
            line for line in stderr.splitlines() if line.startswith(f"[rank {rank} ") and "stopping:" in line
        ]
        assert len(lines) == 1 and f"rank {victim} (learner)" in lines[0], stderr[-3000:]
    assert processes_of(run_dir) == {}, "no rank may outlive the run"
