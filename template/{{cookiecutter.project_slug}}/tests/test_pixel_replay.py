"""Replay of stacked Atari frames: each frame stored once as uint8, and every sampled stack
equal to the one the env itself produced, across batches, episode ends and shards."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf
from tensordict import TensorDict

from {{ cookiecutter.package_name }} import checkpoint, config, recipes, replay, train
from {{ cookiecutter.package_name }}.distributed import topology
from {{ cookiecutter.package_name }}.replay import ReplayClient, ReplayShard
from {{ cookiecutter.package_name }}.replay.frames import FRAMES, NEXT_OBSERVATION, OBSERVATION

from .conftest import (
    REPLAY_RECIPE,
    STEP_ID,
    free_port,
    needs_replay,
    pong_batches,
    tiny_overrides,
)

pytest.importorskip("ale_py", reason="needs the [atari] extra")

# pong_batches' defaults: every env copy ends several episodes, some across batches.
ENVS, STEPS, BATCHES = 2, 20, 4


@pytest.fixture(scope="module")
def batches() -> list[TensorDict]:
    return pong_batches()


def filled(
    batches, shard_count: int = 1, capacity: int = 1000, alpha: float = 0.6, **shard_options
) -> tuple[list[ReplayShard], ReplayClient]:
    shards = [ReplayShard(capacity, alpha, 0.4, shard=i, **shard_options) for i in range(shard_count)]
    refs = [topology.LocalRef(shard) for shard in shards]
    client = ReplayClient(refs, batch_size=64, beta=0.4, prioritized=alpha > 0)
    for batch in batches:
        client.extend(batch)
    client.flush()
    return shards, client


def by_step(batches) -> TensorDict:
    """Every collected transition, indexed by its ``STEP_ID``."""
    everything = torch.cat([batch.reshape(-1) for batch in batches])
    return everything[everything[STEP_ID].argsort()]


def test_frames_are_stored_once_as_uint8(batches):
    (shard,), _ = filled(batches)
    transitions = ENVS * STEPS * BATCHES
    done = torch.cat(batches, 1)["next", "done"].squeeze(-1)
    # Each env copy's first observation, and one after each episode end but the last step's.
    episode_starts = ENVS + int(done[:, :-1].sum())
    assert episode_starts > 2 * ENVS
    # One frame per step, plus the env's whole reset stack (4 frames) at each episode start.
    assert shard.frames.written == transitions + 4 * episode_starts
    stored = shard.frames.read(torch.arange(shard.frames.written))
    assert stored.dtype == torch.uint8 and stored.shape == (shard.frames.written, 84, 84)
    rows = shard.buffer[:]
    assert len(rows) == transitions
    assert OBSERVATION not in rows.keys() and NEXT_OBSERVATION not in rows.keys(True)
    assert rows[FRAMES].shape == (transitions, 5)  # stamps of a stack and the next frame


@pytest.mark.parametrize("shard_count", [1, 2])
def test_sampled_stacks_are_the_envs_own_across_batches_and_episode_ends(batches, shard_count):
    _, client = filled(batches, shard_count)
    truth = by_step(batches)
    seen = set()
    for _ in range(40):
        sample = client.sample()
        assert sample[OBSERVATION].dtype == torch.uint8 and sample[OBSERVATION].shape[1:] == (4, 84, 84)
        expected = truth[sample[STEP_ID]]
        assert torch.equal(sample[OBSERVATION], expected[OBSERVATION])
        assert torch.equal(sample[NEXT_OBSERVATION], expected[NEXT_OBSERVATION])
        seen.update(sample[STEP_ID].tolist())
    done = truth["next", "done"].squeeze(-1)
    # The checks covered the stacks that matter: a last step and a reset stack, whose
    # older frames are the zeros ale-py fills in, not frames of the episode before.
    assert any(done[step] for step in seen)
    reset = [step for step in seen if (truth[step][OBSERVATION][:3] == 0).all()]
    assert reset and all(truth[step][OBSERVATION][3].any() for step in reset)


@pytest.mark.parametrize("alpha", [0.6, 0.0])
def test_transitions_whose_frames_were_overwritten_are_never_sampled(batches, alpha):
    # Frames outrun transitions (reset stacks): in a full small shard, some of the
    # oldest transitions have lost a frame. Drawn uniformly (alpha 0) or by priority alike.
    (shard,), client = filled(batches, capacity=50, alpha=alpha)
    assert not shard.frames.holds(shard.buffer[:][FRAMES]).all()
    truth = by_step(batches)
    for _ in range(20):
        sample = client.sample(prefetch=False)
        assert torch.equal(sample[OBSERVATION], truth[sample[STEP_ID]][OBSERVATION])


def shared_memory_in(monkeypatch, folder) -> None:
    """Reply slots in ``folder``, not /dev/shm: where the client makes them, and where a
    shard accepts them."""
    for module in (replay.client, replay.shard):
        monkeypatch.setattr(module, "SHARED_MEMORY", folder)


def test_frames_through_shared_memory_are_the_envs_own_and_stay_for_a_request(batches, tmp_path, monkeypatch):
    # A folder of this test's own, so that the check for files left behind sees no other
    # test's: the slots are mapped files wherever they live (/dev/shm keeps them in memory).
    shared_memory_in(monkeypatch, tmp_path)
    shard = ReplayShard(1000, 0.6, 0.4)
    client = ReplayClient(
        [topology.LocalRef(shard)], batch_size=16, beta=0.4, batches_per_request=2, share_frames=True
    )
    for batch in batches:
        client.extend(batch)
    client.flush()
    truth = by_step(batches)
    for _ in range(2):  # the first request's batches: their frames come in its reply
        client.sample()
    assert list(client.slots) == [0] and len(client.slots[0]) == 3  # requests_ahead + 2
    slots = {slot.untyped_storage().data_ptr() for slot in client.slots[0]}
    assert not any(tmp_path.iterdir())  # mapped, and their files already gone
    taken = []
    for _ in range(20):
        taken.append(client.sample())
        assert taken[-1][OBSERVATION].untyped_storage().data_ptr() in slots
        # A batch's frames stay as they were while the learner takes another request's batches.
        for sample in taken[-3:]:
            expected = truth[sample[STEP_ID]]
            assert torch.equal(sample[OBSERVATION], expected[OBSERVATION])
            assert torch.equal(sample[NEXT_OBSERVATION], expected[NEXT_OBSERVATION])


def test_without_shared_memory_the_frames_come_in_the_replies(batches, tmp_path, monkeypatch):
    shared_memory_in(monkeypatch, tmp_path / "absent")
    shard = ReplayShard(1000, 0.6, 0.4)
    client = ReplayClient([topology.LocalRef(shard)], batch_size=16, beta=0.4, share_frames=True)
    for batch in batches:
        client.extend(batch)
    client.flush()
    truth = by_step(batches)
    for _ in range(10):
        sample = client.sample()
        assert torch.equal(sample[OBSERVATION], truth[sample[STEP_ID]][OBSERVATION])
    assert client.slots == {} and shard.readers == {}
    # A shard on another machine does not find a learner's slots, and says so; it maps
    # nothing outside shared memory.
    assert not shard.attach("elsewhere", [str(replay.shard.SHARED_MEMORY / "slot-0")], 1024)
    with pytest.raises(ValueError, match="reply slots must be files in"):
        shard.attach("elsewhere", [str(tmp_path / "slot-0")], 1024)


def test_memmap_storage_writes_its_files_in_the_named_directory(batches, tmp_path):
    (shard,), client = filled(batches, storage="memmap", directory=tmp_path / "shard-0")
    assert list((tmp_path / "shard-0" / "transitions").rglob("*.memmap"))  # torchrl's files
    assert (tmp_path / "shard-0" / "frames.memmap").stat().st_size == 1000 * 84 * 84
    truth = by_step(batches)
    sample = client.sample()
    assert torch.equal(sample[NEXT_OBSERVATION], truth[sample[STEP_ID]][NEXT_OBSERVATION])


def sample_over_rpc(rank: int, ports: tuple[int, int], result: dict) -> None:
    """Rank 0, the learner, writes Pong batches to two replay processes (ranks 1 and 2, a
    shard each) and checks what it samples back against what it collected."""
    plan = topology.Topology(rank, world_size=3, replay_ranks=(1, 2), learner_ranks=(0,))
    if plan.role == topology.LEARNER:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=0, world_size=1)
    else:
        topology.host("replay", ReplayShard(1000, 0.6, 0.4, shard=rank - 1))
    batches = pong_batches() if plan.role == topology.LEARNER else None
    topology.connect(plan, "127.0.0.1", ports[1], timeout_s=60, collective_timeout_s=60)
    if plan.role == topology.LEARNER:
        shards = [topology.handle(plan, owner, "replay") for owner in plan.replay_ranks]
        client = ReplayClient(shards, batch_size=64, beta=0.4, share_frames=True)
        for batch in batches:
            client.extend(batch)
        client.flush()
        truth = by_step(batches)
        checked = 0
        for _ in range(10):
            sample = client.sample()
            expected = truth[sample[STEP_ID]]
            assert sample[OBSERVATION].dtype == torch.uint8
            assert torch.equal(sample[OBSERVATION], expected[OBSERVATION])
            assert torch.equal(sample[NEXT_OBSERVATION], expected[NEXT_OBSERVATION])
            checked += sample.numel()
        result["checked"] = checked
        result["shared"] = sorted(client.slots)  # shards writing frames into shared memory
        result["shards"] = sorted(set(sample["shard"].tolist()))
        result["sizes"] = [shard.rpc_sync().stats()["size"] for shard in shards]
        dist.destroy_process_group()
    topology.disconnect(plan)


@pytest.mark.slow
def test_stacks_sampled_over_rpc_from_two_shards_are_the_envs_own():
    topology.bind_to_loopback_unless_named("127.0.0.1")
    with mp.Manager() as manager:
        result = manager.dict()
        mp.spawn(sample_over_rpc, args=((free_port(), free_port()), result), nprocs=3)
        assert result["checked"] == 640 and result["shards"] == result["shared"] == [0, 1], dict(result)
        assert result["sizes"] == [ENVS * STEPS * BATCHES // 2] * 2  # one env copy each


def test_pixel_batches_that_stop_being_a_frame_stack_are_refused(batches):
    _, client = filled(batches[:1])
    broken = batches[1].clone()
    broken[NEXT_OBSERVATION][:, :, 0] += 1
    with pytest.raises(ValueError, match="stopped being a frame stack"):
        client.extend(broken)


def test_non_stacked_observations_go_row_by_row(batches):
    # One frame per observation (no stack to share): stored whole, as CartPole's floats are.
    single = batches[0].clone()
    single[OBSERVATION] = single[OBSERVATION][:, :, -1:]
    single[NEXT_OBSERVATION] = single[NEXT_OBSERVATION][:, :, -1:]
    (shard,), client = filled([single])
    assert shard.frames.written == 0 and shard.buffer[:][OBSERVATION].shape == (ENVS * STEPS, 1, 84, 84)


@needs_replay
@pytest.mark.parametrize("keep_replay", [True, False])
def test_a_checkpoint_with_pixels_keeps_the_replay_or_says_it_did_not(batches, tmp_path, keep_replay):
    overrides = [*tiny_overrides(REPLAY_RECIPE), f"run_dir={tmp_path}", f"checkpoint.replay={keep_replay}"]
    cfg = config.load(overrides, train.DEFAULTS)
    agent = recipes.make_agent(recipes.load(REPLAY_RECIPE), cfg.algo, cfg.env, 2)
    (shard,), client = filled(batches)
    meta = checkpoint.Meta.of_run(cfg, 1024, 10, learners=1, replay_shards=1)
    checkpoint.save(cfg, meta, 0, agent, agent.make_optimizers(), client.shards, lambda: None)

    plan = topology.Topology.plan(1, 0, 1, uses_replay=True)
    resumed = checkpoint.check_resume(OmegaConf.merge(cfg, {"resume": str(tmp_path)}))
    assert resumed.replay is keep_replay
    assert (checkpoint.latest(tmp_path) / "replay-0").exists() is keep_replay
    again = ReplayShard(1000, 0.6, 0.4)
    topology.host("replay", again)
    if keep_replay:
        again.load(str(checkpoint.latest(tmp_path) / "replay-0"))
        assert again.stats() == shard.stats() and again.frames.written == shard.frames.written
        sample, _, _ = again.sample(64)
        truth = by_step(batches)
        assert torch.equal(sample["pixels"][:, :-1], truth[sample[STEP_ID]][OBSERVATION])
        expected = (
            f"at frame 1024, update 10; replay restored: {ENVS * STEPS * BATCHES} transitions in 1 shard(s)"
        )
    else:
        expected = "at frame 1024, update 10; replay not restored (saved with checkpoint.replay=false)"
    assert expected in train.resumed_line(plan, resumed, uses_replay=True)
