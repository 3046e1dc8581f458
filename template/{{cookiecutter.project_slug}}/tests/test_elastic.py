"""Elastic resume: a checkpoint goes on with another number of learners and replay shards.
The shards' transitions are dealt out anew with their priorities (and, for stacked pixels,
the frames they need), and the run goes on to the planned frame count, each frame counted
once."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict

from {{ cookiecutter.package_name }} import checkpoint, config, recipes, train
from {{ cookiecutter.package_name }}.distributed import topology
from {{ cookiecutter.package_name }}.envs import make_env
from {{ cookiecutter.package_name }}.replay import ReplayClient, ReplayShard
from {{ cookiecutter.package_name }}.replay.frames import FRAMES, NEXT_OBSERVATION, OBSERVATION
from {{ cookiecutter.package_name }}.replay.sampler_trees import EPS, stored_priorities

from .conftest import (
    RECIPES,
    REPLAY_RECIPE,
    SMALL,
    STEP_ID,
    collect_one_batch,
    learners_run,
    needs_replay,
    pong_batches,
    read_summary,
    tiny_overrides,
)

ALPHA, BETA = 0.6, 0.4


def cartpole_transitions(count: int) -> TensorDict:
    """``count`` CartPole transitions, numbered by ``STEP_ID``."""
    env = make_env("CartPole-v1", 4, seed=0)
    batch = collect_one_batch(env, None, count).reshape(-1)
    env.close()
    batch[STEP_ID] = torch.arange(count)
    return batch


def saved_shards(tmp_path: Path, shards: list[ReplayShard]) -> list[Path]:
    folders = [tmp_path / f"replay-{i}" for i in range(len(shards))]
    for shard, folder in zip(shards, folders, strict=True):
        shard.save(str(folder))
    return folders


def contents(shards: list[ReplayShard]) -> dict[int, float]:
    """``STEP_ID`` -> priority of every transition the shards hold; each id once."""
    found = {}
    for shard in shards:
        rows = shard.buffer[:]
        priorities = stored_priorities(shard.buffer, rows["index"])
        for step, priority in zip(rows[STEP_ID].tolist(), priorities.tolist(), strict=True):
            assert step not in found, f"transition {step} is in two shards"
            found[step] = priority
    return found


def assert_same_priorities(after: dict[int, float], before: dict[int, float]) -> None:
    steps = sorted(before)
    expected, found = torch.tensor([before[s] for s in steps]), torch.tensor([after[s] for s in steps])
    torch.testing.assert_close(found, expected, rtol=1e-5, atol=1e-12)


def restored(
    folders: list[Path], parts: int, capacity: int, alpha: float = ALPHA, **options
) -> list[ReplayShard]:
    """The shards a run with ``parts`` replay shards makes of ``folders``."""
    size = math.ceil(capacity / parts)
    shards = [ReplayShard(size, alpha, BETA, shard=i, **options) for i in range(parts)]
    for part, shard in enumerate(shards):
        shard.restore(folders, part, parts)
    return shards


def test_the_shards_priorities_are_read_back_as_they_were_set():
    # stored_priorities reads torchrl's private sum tree: this pins what it reads.
    shard = ReplayShard(100, ALPHA, BETA)
    shard.extend(cartpole_transitions(64))
    priorities = torch.cat([torch.linspace(1e-6, 30.0, 63), torch.zeros(1)])
    shard.buffer.update_priority(torch.arange(64), priorities)
    read = stored_priorities(shard.buffer, torch.arange(64))
    torch.testing.assert_close(read, priorities, rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize(("saved", "parts"), [(1, 2), (2, 3), (3, 2), (2, 1)])
def test_transitions_are_dealt_to_another_shard_count_with_their_priorities(tmp_path, saved, parts):
    capacity = 300  # all shards together; the saved ones are full and have wrapped
    size = math.ceil(capacity / saved)
    shards = [ReplayShard(size, ALPHA, BETA, shard=i) for i in range(saved)]
    client = ReplayClient([topology.LocalRef(shard) for shard in shards], batch_size=16, beta=BETA)
    transitions = cartpole_transitions(480)
    for batch in transitions.split(40):
        client.extend(batch)
    client.flush()
    for _ in range(10):  # priorities of every kind, as training leaves them
        sample = client.sample()
        client.update_priority(sample, torch.rand(len(sample)) * 5)
    client.flush()
    for shard in shards:
        shard.stale_updates = 3 + shard.shard  # counters that are totals over the shards
    before = contents(shards)
    assert len(before) == capacity

    again = restored(saved_shards(tmp_path, shards), parts, capacity)
    after = contents(again)
    assert after.keys() == before.keys()  # every transition once, in one shard
    assert_same_priorities(after, before)
    sizes = [shard.stats()["size"] for shard in again]
    assert max(sizes) - min(sizes) <= 1
    for key in ("inserted", "stale_updates"):
        assert sum(s.stats()[key] for s in again) == sum(s.stats()[key] for s in shards)
    if saved == 1:
        # Oldest first in each new shard: the next writes overwrite the oldest, as before.
        for shard in again:
            assert shard.buffer[:][STEP_ID].diff().gt(0).all()
    # The weights of a batch drawn across the new shards are those one buffer holding
    # everything gives: (p_i / p_min) ** -beta over the transformed priorities of all.
    batch = ReplayClient([topology.LocalRef(shard) for shard in again], batch_size=64, beta=BETA).sample()
    mass = {step: (priority + EPS) ** ALPHA for step, priority in after.items()}
    lowest = min(mass.values())
    expected = torch.tensor([(mass[step] / lowest) ** -BETA for step in batch[STEP_ID].tolist()])
    torch.testing.assert_close(batch["priority_weight"], expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("saved_alpha", "alpha"), [(ALPHA, 0.3), (ALPHA, 0.0), (0.0, ALPHA)])
def test_shards_go_on_with_another_alpha(tmp_path, saved_alpha, alpha):
    """The same shard count with another ``replay.alpha``: every transition is kept once,
    drawn by the new rule, with the priority it had (a uniform shard's come back as 1)."""
    shards = [ReplayShard(100, saved_alpha, BETA, shard=i) for i in range(2)]
    refs = [topology.LocalRef(shard) for shard in shards]
    client = ReplayClient(refs, batch_size=16, beta=BETA, prioritized=saved_alpha > 0)
    for batch in cartpole_transitions(160).split(40):
        client.extend(batch)
    client.flush()
    sample = client.sample()
    client.update_priority(sample, 1 + torch.rand(len(sample)) * 5)
    client.flush()
    before = contents(shards) if saved_alpha > 0 else dict.fromkeys(range(160), 1.0)

    again = restored(saved_shards(tmp_path, shards), 2, 200, alpha=alpha)
    steps = sorted(step for shard in again for step in shard.buffer[:][STEP_ID].tolist())
    assert steps == list(range(160))
    refs = [topology.LocalRef(shard) for shard in again]
    batch = ReplayClient(refs, batch_size=64, beta=BETA, prioritized=alpha > 0).sample()
    assert ("priority_weight" in batch.keys()) == (alpha > 0)
    if alpha > 0:
        assert {shard.buffer.sampler.alpha for shard in again} == {alpha}
        assert_same_priorities(contents(again), before)


def stacks(shard: ReplayShard) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every transition's ``STEP_ID``, observation and next observation, as a shard rebuilds
    them from its frames, for the transitions that still have their frames."""
    rows = shard.buffer[:]
    held = shard.frames.holds(rows[FRAMES])
    pixels = shard.frames.read(rows[FRAMES][held])
    return rows[STEP_ID][held], pixels[:, :-1], pixels[:, 1:]


@pytest.mark.parametrize(("capacity", "parts"), [(1000, 2), (1000, 3), (120, 2), (100, 3)])
def test_stacked_frames_go_with_their_transitions_to_another_shard_count(tmp_path, capacity, parts):
    batches = pong_batches()
    (shard,) = [ReplayShard(capacity, ALPHA, BETA, storage="memmap", directory=tmp_path / "s")]
    client = ReplayClient([topology.LocalRef(shard)], batch_size=16, beta=BETA)
    for batch in batches:
        client.extend(batch)
    client.flush()
    shard.buffer.update_priority(torch.arange(len(shard.buffer)), torch.rand(len(shard.buffer)) + 0.1)
    before = contents([shard])
    held_before = stacks(shard)[0]
    if capacity < 160:  # frames outrun transitions: some of the oldest have lost theirs
        assert len(held_before) < len(before)

    again = restored(saved_shards(tmp_path, [shard]), parts, capacity)
    after = contents(again)
    assert after.keys() == before.keys()
    assert_same_priorities(after, before)
    truth = torch.cat([batch.reshape(-1) for batch in batches])
    truth = truth[truth[STEP_ID].argsort()]  # row i is transition i
    held_after = []
    for part in again:
        step, observation, following = stacks(part)
        assert torch.equal(observation, truth[step][OBSERVATION])
        assert torch.equal(following, truth[step][NEXT_OBSERVATION])
        held_after += step.tolist()
    # The transitions that had their frames still have them; the others are never sampled.
    # From full shards, an episode split between two parts stores its 4 shared frames
    # twice: a part can lose the frames of its oldest few, as any full shard does.
    assert set(held_after) <= set(held_before.tolist())
    if capacity < 160:
        assert len(held_before) - len(held_after) <= 4 * (parts - 1)
    else:
        assert len(held_after) == len(held_before)
    # Each env copy's episode stays in one shard: the frames are stored no more than before.
    assert sum(part.frames.written for part in again) <= shard.frames.written
    for part in again:
        batch, _, _ = part.sample(16)
        assert torch.equal(batch["pixels"][:, :-1], truth[batch[STEP_ID]][OBSERVATION])


@needs_replay
def test_a_checkpoint_resumes_on_another_layout_and_says_so(tmp_path, capsys):
    cfg = config.load([*tiny_overrides(REPLAY_RECIPE), f"run_dir={tmp_path}"], train.DEFAULTS)
    recipe = recipes.load(REPLAY_RECIPE)
    agent = recipes.make_agent(recipe, cfg.algo, cfg.env, 2)
    shards = [ReplayShard(100, ALPHA, BETA, shard=i) for i in range(2)]
    client = ReplayClient([topology.LocalRef(shard) for shard in shards], batch_size=4, beta=BETA)
    for batch in cartpole_transitions(64).select(*agent.batch_keys).split(16):
        client.extend(batch)
    meta = checkpoint.Meta.of_run(cfg, 1024, 10, learners=1, replay_shards=2)
    checkpoint.save(cfg, meta, 0, agent, agent.make_optimizers(), client.shards, lambda: None)
    cpu = torch.device("cpu")

    # Refused before: learners and replay shards now change freely; the recipe and env do not.
    resume = [*tiny_overrides(REPLAY_RECIPE), f"resume={tmp_path}", f"run_dir={tmp_path}", "--print-config"]
    assert train.main([*resume, "fabric.devices=3", "replay.processes=2"]) == 0
    assert train.main([*resume, "env.id=Acrobot-v1"]) == 2
    assert "is a checkpoint of recipe" in capsys.readouterr().err

    resumed = checkpoint.check_resume(OmegaConf.merge(cfg, {"resume": str(tmp_path)}))
    assert resumed.changes(learners=3, shards=1) == ["learners 1 -> 3", "replay shards 2 -> 1"]
    folder = resumed.folder
    one = ReplayShard(200, ALPHA, BETA)
    one.restore([folder / "replay-0", folder / "replay-1"], 0, 1)
    topology.host("replay", one)
    assert one.stats()["size"] == 64
    # One process, one shard: the line names what changed from the checkpoint's two.
    plan = topology.Topology.plan(1, 0, 1, uses_replay=True)
    line = train.resumed_line(plan, resumed, uses_replay=True)
    assert line.endswith("(replay shards 2 -> 1); replay restored: 64 transitions from 2 shards into 1")

    # A learner the checkpoint had no generators for seeds its own.
    again = recipes.make_agent(recipe, cfg.algo, cfg.env, 2)
    draws = []
    for _ in range(2):
        checkpoint.restore_learner(folder, 2, again, again.make_optimizers(), cpu, fresh_seed=7)
        draws.append(torch.rand(3))
    assert torch.equal(draws[0], draws[1])
    assert not (folder / "rng-2.pt").exists()


@needs_replay
@pytest.mark.slow
def test_one_shard_and_two_learners_resume_as_two_shards_and_three_learners(tmp_path):
    run_dir = tmp_path / "run"
    overrides = [f"recipe={REPLAY_RECIPE}", *SMALL, "replay.capacity=2000", f"run_dir={run_dir}"]
    first = learners_run(2, *overrides, "replay.processes=1")
    assert read_summary(first)["frames_collected"] == 384
    folder = checkpoint.latest(run_dir)
    meta = checkpoint.Meta.read(folder)
    assert (meta.frames, meta.learners, meta.replay_shards) == (384, 2, 1)

    # The shards the resumed run's replay processes make of the checkpoint: every transition
    # once, with the priority it had.
    saved = ReplayShard(2000, ALPHA, BETA)
    saved.load(str(folder / "replay-0"))
    dealt = [ReplayShard(1000, ALPHA, BETA, shard=i) for i in range(2)]
    for part, shard in enumerate(dealt):
        shard.restore([folder / "replay-0"], part, 2)
    assert [shard.stats()["size"] for shard in dealt] == [192, 192]
    assert priority_table([saved]) == pytest.approx(priority_table(dealt), rel=1e-5, abs=1e-9)

    # Steps of 3 x 32 frames from 384 to 768; learning started long ago: 3 x 2 updates a
    # step, each of 8 transitions dealt out as 3, 3 and 2.
    resumed = learners_run(3, *overrides, "replay.processes=2", "total_frames=768", f"resume={run_dir}")
    summary = read_summary(resumed)
    assert summary["roles"] == {"0": "learner", "1": "learner", "2": "learner", "3": "replay", "4": "replay"}
    changed = "(learners 2 -> 3, replay shards 1 -> 2)"
    assert f"{changed}; replay restored: 384 transitions from 1 shard into 2" in resumed.stderr
    assert summary["frames_collected"] == 768
    assert summary["replay_size"] == 768  # what was saved, and each new frame once
    # Each learner writes to the shards in turn, starting from its own: 6 x 32 frames each.
    assert summary["replay_shard_sizes"] == [192 + 192, 192 + 192]
    assert summary["updates"] == meta.updates + 4 * 6
    assert len(set(summary["learner_param_checksums"].values())) == 1
    assert all(rollouts["frames"] == 4 * 32 for rollouts in summary["learner_rollouts"].values())


def priority_table(shards: list[ReplayShard]) -> list[tuple]:
    """Every transition (its observation, action and next observation) with its priority, sorted."""
    table = []
    for shard in shards:
        rows = shard.buffer[:]
        priorities = stored_priorities(shard.buffer, rows["index"])
        action = rows["action"].float().reshape(len(rows), -1)
        keys = torch.cat([rows[OBSERVATION], action, rows[NEXT_OBSERVATION]], -1).tolist()
        table += [(tuple(key), priority) for key, priority in zip(keys, priorities.tolist(), strict=True)]
    return [priority for _, priority in sorted(table)]


@pytest.mark.slow
@pytest.mark.skipif("ppo" not in RECIPES, reason="this project has no ppo recipe")
def test_an_on_policy_run_resumes_on_more_learners(tmp_path):
    run_dir = tmp_path / "run"
    overrides = [*tiny_overrides("ppo"), "checkpoint.every=1024", f"run_dir={run_dir}"]
    read_summary(learners_run(2, *overrides, "total_frames=1024"))
    folder = checkpoint.latest(run_dir)
    meta = checkpoint.Meta.read(folder)
    assert (meta.learners, meta.replay_shards) == (2, 0)
    assert sorted(path.name for path in folder.glob("rng-*.pt")) == ["rng-0.pt", "rng-1.pt"]

    # One step of 3 x 256 frames: 1024 to 1792; 2 epochs of 2 minibatches each.
    resumed = learners_run(3, *overrides, "total_frames=1792", f"resume={run_dir}")
    summary = read_summary(resumed)
    line = f"resumed from {folder} at frame 1024, update {meta.updates} (learners 2 -> 3)"
    assert line in resumed.stderr
    assert summary["frames_collected"] == 1792
    assert summary["updates"] == meta.updates + 4
    assert len(set(summary["learner_param_checksums"].values())) == 1
    assert [rollouts["frames"] for rollouts in summary["learner_rollouts"].values()] == [256] * 3
