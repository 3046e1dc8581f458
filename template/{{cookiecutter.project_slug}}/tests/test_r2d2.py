"""The R2D2 recipe: sequences cut from real collector batches, the recurrent state they
keep, its targets; sequences of Atari frames in replay, each frame stored once; a run on
three learners and a replay process, resumed on one."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from torchrl.collectors import Collector

from {{ cookiecutter.package_name }} import checkpoint
from {{ cookiecutter.package_name }}.distributed import topology
from {{ cookiecutter.package_name }}.envs import make_env
from {{ cookiecutter.package_name }}.recipes import r2d2
from {{ cookiecutter.package_name }}.replay import ReplayClient, ReplayShard
from {{ cookiecutter.package_name }}.replay.frames import FRAMES, PIXELS
from {{ cookiecutter.package_name }}.replay.shard import SHARD

from .conftest import (
    ATARI_SHORT,
    expected_updates,
    learners_run,
    read_summary,
    replay_items,
    run_command,
    saved_shard,
    tiny_overrides,
)

POPGYM_CARTPOLE = "popgym-PositionOnlyCartPoleEasy-v0"
# 16 steps a batch and a stride of 7: sequences start anywhere in a batch, and some steps
# wait for the next one. Random actions end CartPole's episodes within ~20 steps: many
# sequences hold an episode's start after their first step.
COPIES, STEPS, BATCHES = 3, 16, 6
LENGTH, OVERLAP = 10, 3


# Pong's single frames (R2D2's Atari setting), episodes of 25 steps: sequences cross them.
PONG = {"id": "ALE/Pong-v5", "frame_stack": 1, "kwargs": {"max_num_frames_per_episode": 100}}


def sequences_collected(env_settings: str | dict):
    """A small agent, the collector batches it acted in (epsilon 1: random actions, the
    LSTM still stepping), and the items ``replay_items`` made of each batch in turn."""
    torch.manual_seed(0)
    cfg = r2d2.Config(hidden_sizes=[16], lstm_hidden_size=8, sequence_length=LENGTH, overlap=OVERLAP)
    spec_env = make_env(env_settings, COPIES, seed=0)
    agent = r2d2.Agent(cfg, spec_env)
    spec_env.close()
    env = make_env(env_settings, COPIES, seed=0, policy=agent.policy)
    collector = Collector(
        env, agent.policy, frames_per_batch=COPIES * STEPS, total_frames=COPIES * STEPS * BATCHES,
        track_traj_ids=False, auto_register_policy_transforms=False, use_buffers=False,
    )  # fmt: skip
    batches, items = [], []
    with torch.no_grad():
        for batch in collector:
            batches.append(batch.clone())
            items.append(agent.replay_items(batch))
    collector.shutdown()
    return agent, batches, items


@pytest.fixture(scope="module")
def collected():
    pytest.importorskip("popgym", reason="needs the [popgym] extra")
    return sequences_collected(POPGYM_CARTPOLE)


@pytest.fixture(scope="module")
def pong_items() -> list:
    pytest.importorskip("ale_py", reason="needs the [atari] extra")
    return sequences_collected(PONG)[2]


def test_sequences_overlap_as_configured_and_never_miss_or_repeat_a_step_across_batches(collected):
    """Each copy's stream, read back from the batches joined in time, is cut every
    ``LENGTH - OVERLAP`` steps into ``LENGTH``-step sequences, in order, across batches."""
    _, batches, items = collected
    stream = torch.cat(batches, 1)  # [copies, all steps]
    stride = LENGTH - OVERLAP
    starts = range(0, STEPS * BATCHES - LENGTH + 1, stride)
    expected = {copy: [stream[copy, start : start + LENGTH] for start in starts] for copy in range(COPIES)}
    taken = {copy: [] for copy in range(COPIES)}
    for batch_items in items:  # [copies, sequences], each copy's in order
        assert batch_items.shape[0] == COPIES
        for copy in range(COPIES):
            taken[copy].extend(batch_items[copy].unbind(0))
    for copy in range(COPIES):
        assert len(taken[copy]) == len(starts)
        for sequence, window in zip(taken[copy], expected[copy], strict=True):
            assert torch.equal(sequence["observation"], window["observation"])
            assert torch.equal(sequence["action"], window["action"])
            assert torch.equal(sequence["next", "reward"], window["next", "reward"])
            assert torch.equal(sequence[r2d2.IS_INIT], window[r2d2.IS_INIT])
    # A batch gives the sequences it completes: after 16, 32, ... steps, those starting at
    # 0; 7, 14, 21; 28, 35; ...
    assert [batch_items.shape[1] for batch_items in items] == [1, 3, 2, 2, 3, 2]


def test_a_batch_shorter_than_a_sequence_completes_none_and_its_steps_wait(collected):
    """Sequences longer than a collector batch: the first batch gives no item (replay
    takes it as nothing), and its steps start the first sequence the next batch completes."""
    _, batches, _ = collected
    cfg = r2d2.Config(hidden_sizes=[16], lstm_hidden_size=8, sequence_length=STEPS + 4, overlap=OVERLAP)
    spec_env = make_env(POPGYM_CARTPOLE, COPIES, seed=0)
    agent = r2d2.Agent(cfg, spec_env)
    spec_env.close()
    items = [agent.replay_items(batch) for batch in batches]
    assert items[0].batch_size == torch.Size([0])
    stream = torch.cat(batches, 1)
    assert items[1].shape == (COPIES, 1)
    assert torch.equal(items[1]["observation"][:, 0], stream[:, : STEPS + 4]["observation"])
    starts = range(0, STEPS * BATCHES - cfg.sequence_length + 1, cfg.sequence_length - OVERLAP)
    assert sum(batch_items.batch_size.numel() for batch_items in items) == COPIES * len(starts)


def test_the_state_kept_with_a_sequence_is_the_one_the_collector_acted_from(collected):
    """The state carried from one collector batch to the next, zeroed at episode starts;
    each sequence's stored state is its first step's; and the LSTM run through the
    sequence from it (resetting at episode starts inside) gives the Q values the collector
    acted on at every step."""
    agent, batches, items = collected
    for before, after in zip(batches, batches[1:], strict=False):
        for key in r2d2.STATE:
            carried = before["next", key][:, -1]
            first = after[key][:, 0]
            restarted = after[r2d2.IS_INIT][:, 0].squeeze(-1)
            assert torch.equal(first[~restarted], carried[~restarted])
            assert not first[restarted].any()
    stream = torch.cat(batches, 1)
    stride = LENGTH - OVERLAP
    sequences = torch.cat([batch_items.reshape(-1) for batch_items in items])
    assert sequences[r2d2.IS_INIT][:, 1:].any(), "no sequence crosses an episode's start"
    with torch.no_grad():
        q = agent.q_network.sequences(
            sequences["observation"], sequences[r2d2.IS_INIT], tuple(sequences[key] for key in r2d2.STATE), 0
        )
    # The items came batch after batch, copy after copy: each copy's k-th starts at k * stride.
    position, seen = 0, [0] * COPIES
    for batch_items in items:
        for copy in range(COPIES):
            for _ in range(batch_items.shape[1]):
                start = seen[copy] * stride
                window = stream[copy, start : start + LENGTH]
                for key in r2d2.STATE:
                    assert torch.equal(sequences[position][key], window[key][0])
                torch.testing.assert_close(q[position], window[r2d2.ACTION_VALUE])
                seen[copy] += 1
                position += 1


def replayed(items: list, shard_count: int) -> tuple[list[ReplayShard], ReplayClient]:
    shards = [ReplayShard(1000, 0.6, 0.4, shard=i) for i in range(shard_count)]
    client = ReplayClient([topology.LocalRef(shard) for shard in shards], batch_size=8, beta=0.4)
    for batch_items in items:
        client.extend(batch_items, OVERLAP)
    client.flush()
    return shards, client


def held_by(items: list, shard: int, shard_count: int):
    """The sequences that shard ``shard`` of ``shard_count`` stored, in order: each batch's
    of the copies it takes (copy n goes to shard n % shard_count), copy after copy."""
    mine = [copy for copy in range(COPIES) if copy % shard_count == shard]
    return torch.cat([batch_items[mine].reshape(-1) for batch_items in items])


def frames_once(sequences: int, copies: int) -> int:
    """A copy's first sequence stores all its steps' frames, each later one the steps it
    does not share with the one before."""
    return copies * LENGTH + (sequences - copies) * (LENGTH - OVERLAP)


@pytest.mark.parametrize("shard_count", [1, 2])
def test_sequences_of_frames_store_each_frame_once_and_sample_as_collected(pong_items, shard_count):
    shards, client = replayed(pong_items, shard_count)
    for index, shard in enumerate(shards):
        stored = shard.buffer[:]
        assert len(stored) == len(held_by(pong_items, index, shard_count))
        assert "observation" not in stored.keys() and stored[FRAMES].shape == (len(stored), LENGTH)
        assert shard.frames.written == frames_once(len(stored), len(range(index, COPIES, shard_count)))
        assert shard.frames.frame_shape == (1, 84, 84)
    crossed = False
    for _ in range(10):
        sample = client.sample()
        assert sample["observation"].dtype == torch.uint8
        assert sample["observation"].shape == (8, LENGTH, 1, 84, 84)
        for sequence in sample:
            truth = held_by(pong_items, int(sequence[SHARD]), shard_count)[int(sequence["index"])]
            assert torch.equal(sequence["observation"], truth["observation"])
            assert torch.equal(sequence["action"], truth["action"])
            crossed = crossed or bool(sequence[r2d2.IS_INIT][1:].any())
    assert crossed, "no sampled sequence crosses an episode's start"


@pytest.mark.parametrize(("saved", "parts"), [(2, 1), (1, 2)])
def test_sequences_of_frames_resume_on_other_shards_with_each_frame_once(pong_items, tmp_path, saved, parts):
    """A checkpoint's shards dealt onto another number of shards: every sequence keeps its
    frames, and a copy's overlapping sequences stay together, so no frame is stored twice."""
    shards, _ = replayed(pong_items, saved)
    folders = [tmp_path / f"replay-{index}" for index in range(saved)]
    for shard, folder in zip(shards, folders, strict=True):
        shard.save(str(folder))
    truth = torch.cat([held_by(pong_items, index, saved) for index in range(saved)])
    restored = [ReplayShard(1000, 0.6, 0.4, shard=part) for part in range(parts)]
    for part, shard in enumerate(restored):
        shard.restore(folders, part, parts)
    assert sum(len(shard.buffer) for shard in restored) == len(truth)
    assert sum(shard.frames.written for shard in restored) == frames_once(len(truth), COPIES)
    for shard in restored:
        stored = shard.buffer[:]
        assert len(stored) > 0
        pixels = shard.frames.read(stored[FRAMES])
        for sequence, observation in zip(stored, pixels, strict=True):
            # The sequence it was: the one with its actions, flags and observations.
            same = (truth["action"] == sequence["action"]).flatten(1).all(-1)
            same &= (truth[r2d2.IS_INIT] == sequence[r2d2.IS_INIT]).flatten(1).all(-1)
            assert any(torch.equal(observation, truth["observation"][i]) for i in torch.nonzero(same)[:, 0])


def test_n_step_targets_stop_at_episode_ends_and_the_value_rescaling_inverts():
    gamma, n = 0.5, 2
    reward = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    # Step 1 terminates its episode; step 3 is cut by a time limit (done, not terminated).
    done = torch.tensor([[False, True, False, True, False]])
    terminated = torch.tensor([[False, True, False, False, False]])
    bootstrap = torch.tensor([[10.0, 20.0, 30.0, 40.0, 50.0]])
    returns, valid = r2d2.n_step_targets(reward, done, terminated, bootstrap, gamma, n)
    # t=0: r0 + g r1, ends at the termination; t=1: r1; t=2: r2 + g r3, cut by the time
    # limit: no target; t=3: cut at once; t=4: t + n beyond the sequence.
    assert valid.tolist() == [[True, True, False, False, False]]
    assert returns[0, :2].tolist() == [1.0 + 0.5 * 2.0, 2.0]
    running = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    returns, valid = r2d2.n_step_targets(running, running.bool() & False, running.bool() & False,
                                         bootstrap.new_tensor([[1, 2, 3, 4, 5, 6.0]]), gamma, n)  # fmt: skip
    assert valid.tolist() == [[True, True, True, True, False, False]]
    assert returns[0, 0].item() == 1 + 0.5 + 0.25 * 3  # bootstraps from step t + 2
    values = torch.linspace(-500, 500, 101)
    torch.testing.assert_close(r2d2.rescale_inverse(r2d2.rescale(values)), values, rtol=1e-4, atol=1e-3)


def test_the_dueling_head_is_a_value_plus_advantages_that_average_to_zero():
    torch.manual_seed(0)
    head = r2d2.DuelingHead(8, 4)
    memory = torch.randn(5, 8)
    q = head(memory)
    assert q.shape == (5, 4)
    torch.testing.assert_close(q.mean(-1, keepdim=True), head.value(memory))
    # Both streams learn from the Q values.
    q[:, 0].sum().backward()
    assert all(parameter.grad.abs().sum() > 0 for parameter in head.parameters())


@pytest.mark.slow
def test_r2d2_trains_on_three_learners_identically_with_exact_frames_and_resumes_on_one(tmp_path):
    """Three learners and two replay processes: every frame collected once, each env
    copy's sequences in replay, each whole in one of the shards, the learners identical;
    the run's checkpoint, its two shards of sequences and their states, goes on in one
    process, dealt into its one shard (new episodes: the steps waiting for a sequence are
    dropped), to the frame asked for."""
    pytest.importorskip("popgym", reason="needs the [popgym] extra")
    recipe = "r2d2"
    run_dir = tmp_path / "run"
    overrides = [*tiny_overrides(recipe), f"run_dir={run_dir}"]
    first = [*overrides, "total_frames=3072", "checkpoint.every=3072", "replay.processes=2"]
    summary = read_summary(learners_run(3, *first))
    roles = {"0": "learner", "1": "learner", "2": "learner", "3": "replay", "4": "replay"}
    assert summary["roles"] == roles
    assert summary["frames_collected"] == 3072
    assert summary["replay_size"] == replay_items(recipe, 3072, learners=3)
    assert all(size > 0 for size in summary["replay_shard_sizes"]) and len(summary["replay_shard_sizes"]) == 2
    assert summary["updates"] == expected_updates(recipe, 3)
    assert len(set(summary["learner_param_checksums"].values())) == 1
    assert math.isfinite(summary["eval_return"])

    result = run_command([sys.executable, "train.py", *overrides, "total_frames=4608", "resume=auto"])
    resumed = read_summary(result)
    assert "replay restored" in result.stderr
    assert resumed["frames_collected"] == 4608
    assert resumed["replay_size"] == summary["replay_size"] + replay_items(recipe, 4608 - 3072)
    assert resumed["updates"] == summary["updates"] + (4608 - 3072) // 256 * 4
    assert math.isfinite(resumed["eval_return"])


@pytest.mark.slow
def test_the_atari_defaults_replay_sequences_of_single_frames_each_stored_once(tmp_path):
    """recipe=r2d2 on Atari takes the paper's sequences (80 steps overlapping by 40) of
    single 84x84 frames (env.frame_stack=1) and its dueling head, here on 2 learners of 2
    games each, a replay process and a small network: 3 batches of 80 steps give each
    game's sequences starting at steps 0, 40, 80, 120 and 160, each one replay item of 80
    frames, which reach the learners through shared memory. The replay process stores each
    frame once: as many frames as were collected. The run trains and plays its greedy
    episode, its learners identical."""
    pytest.importorskip("ale_py", reason="needs the [atari] extra")
    small = [
        "env.num_envs=2",
        "collector.frames_per_batch=160",
        "total_frames=960",
        "replay.capacity=32",
        "algo.learning_starts=0",
        "algo.batch_size=4",
        "algo.hidden_sizes=[32]",
        "algo.lstm_hidden_size=32",
        "eval.episodes=1",
        "checkpoint.every=960",
    ]
    overrides = ["recipe=r2d2", "env.id=ALE/Pong-v5", ATARI_SHORT, *small, f"run_dir={tmp_path}"]
    summary = read_summary(learners_run(2, *overrides))
    assert summary["frames_collected"] == 960 and summary["replay_size"] == 20
    assert summary["replay_shared_memory_readers"] == [2]
    assert summary["updates"] == 6 and math.isfinite(summary["eval_return"])
    assert len(set(summary["learner_param_checksums"].values())) == 1
    shard = saved_shard(tmp_path)
    assert shard.frames.written == 960
    sample, *_ = shard.sample(4)
    assert sample[PIXELS].shape == (4, 80, 1, 84, 84) and sample[PIXELS].dtype == torch.uint8
    agent = torch.load(tmp_path / checkpoint.FINAL, weights_only=True)["agent"]
    assert agent["q_network.head.value.0.weight"].shape == (32, 32)
