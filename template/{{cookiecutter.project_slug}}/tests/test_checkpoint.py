"""Checkpoints: written whole or not at all, pruned, refused when they do not fit the run; a
run_dir holds one run; a default run stopped by Ctrl-C goes on from where it stopped, and a
3-rank run killed with SIGKILL from its last checkpoint, to the right frame count."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import sys
import time

import pytest
import torch
from omegaconf import OmegaConf

from {{ cookiecutter.package_name }} import checkpoint, config, recipes, train
from {{ cookiecutter.package_name }}.distributed.topology import LocalRef
from {{ cookiecutter.package_name }}.distributed.watchdog import RankFailure
from {{ cookiecutter.package_name }}.envs import make_env
from {{ cookiecutter.package_name }}.recorder import logged_rows
from {{ cookiecutter.package_name }}.replay import ReplayShard

from .conftest import (
    RECIPES,
    REPLAY_RECIPE,
    RUNTIME_RECIPE,
    expected_updates,
    fabric_command,
    launch,
    needs_replay,
    needs_runtime_recipe,
    processes_of,
    read_summary,
    run_command,
    tiny_overrides,
)


class OneLearner:
    """What checkpoint.save needs of a one-process run: an agent, its optimizer, a shard."""

    def __init__(self, run_dir, keep: int = 2) -> None:
        self.cfg = config.load(
            [*tiny_overrides(REPLAY_RECIPE), f"run_dir={run_dir}", f"checkpoint.keep={keep}"], train.DEFAULTS
        )
        self.agent = recipes.make_agent(recipes.load(REPLAY_RECIPE), self.cfg.algo, self.cfg.env, 2)
        self.optimizers = self.agent.make_optimizers()
        self.shard = ReplayShard(100, 0.6, 0.4)
        env = make_env(self.cfg.env.id, 2, seed=0)
        self.shard.extend(env.rollout(8).reshape(-1).select(*self.agent.batch_keys))

    def save(self, frames: int) -> None:
        meta = checkpoint.Meta.of_run(self.cfg, frames, frames // 10, learners=1, replay_shards=1)
        checkpoint.save(self.cfg, meta, 0, self.agent, self.optimizers, [LocalRef(self.shard)], lambda: None)


@needs_replay
def test_a_crash_while_writing_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    run = OneLearner(tmp_path)
    run.save(1024)
    first = checkpoint.training_dir(tmp_path, 1024)
    assert checkpoint.latest(tmp_path) == first

    def crash(*args, **kwargs):
        raise OSError("disk full")

    with monkeypatch.context() as patch:
        patch.setattr(checkpoint.Meta, "write", crash)
        with pytest.raises(RankFailure, match="disk full"):  # one line, as a full disk says it
            run.save(2048)
    # The half-written one is invisible; the previous one still loads and fits the run.
    assert checkpoint.latest(tmp_path) == first
    assert checkpoint.partial_dir(checkpoint.training_dir(tmp_path, 2048)).is_dir()
    meta = checkpoint.check_resume(OmegaConf.merge(run.cfg, {"resume": str(tmp_path)}))
    assert (meta.frames, meta.updates) == (1024, 102)
    state = torch.load(first / "agent.pt", weights_only=True)
    run.agent.load_state_dict(state["agent"])
    restored = ReplayShard(100, 0.6, 0.4)
    restored.load(str(first / "replay-0"))
    assert restored.stats() == run.shard.stats()

    run.save(2048)  # the next write replaces what the crash left
    assert checkpoint.latest(tmp_path) == checkpoint.training_dir(tmp_path, 2048)
    assert not checkpoint.partial_dir(checkpoint.training_dir(tmp_path, 2048)).exists()


DAMAGE = {
    "truncated": lambda folder: (folder / "agent.pt").write_bytes((folder / "agent.pt").read_bytes()[:100]),
    "shard missing": lambda folder: shutil.rmtree(folder / "replay-0"),
    "meta unreadable": lambda folder: (folder / "meta.json").write_text('{"recipe": '),
}
REASONS = {
    "truncated": r"agent\.pt has 100 bytes, \d+ when written",
    "shard missing": r"replay-0/\S+ is missing",
    "meta unreadable": r"meta\.json cannot be read \(JSONDecodeError\)",
}


@needs_replay
@pytest.mark.parametrize("kind", list(DAMAGE))
def test_resume_auto_skips_a_damaged_checkpoint_in_one_line_and_goes_on_from_the_newest_whole(
    tmp_path, caplog, kind
):
    run = OneLearner(tmp_path)
    run.save(1024)
    run.save(2048)
    newest = checkpoint.training_dir(tmp_path, 2048)
    DAMAGE[kind](newest)
    cfg = OmegaConf.merge(run.cfg, {"resume": "auto"})
    with caplog.at_level("WARNING"):
        resumed = checkpoint.check_resume(cfg)
    assert resumed.folder == checkpoint.training_dir(tmp_path, 1024) and resumed.frames == 1024
    (line,) = [record.getMessage() for record in caplog.records if record.name == checkpoint.__name__]
    assert re.fullmatch(rf"resume: skipping {newest}: {REASONS[kind]}", line), line
    checkpoint.check_run_dir(cfg, resumed)  # the damaged newest does not refuse the run
    # Named on its own, a damaged checkpoint is one error line, not a traceback.
    with pytest.raises(config.ConfigError, match=rf"resume: checkpoint {newest} is damaged: {REASONS[kind]}"):
        checkpoint.check_resume(OmegaConf.merge(run.cfg, {"resume": str(newest)}))


@needs_replay
def test_a_full_disk_fails_the_write_in_one_line_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    run = OneLearner(tmp_path)
    run.save(1024)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", full)
    target = checkpoint.training_dir(tmp_path, 2048)
    with pytest.raises(RankFailure, match=rf"^cannot write checkpoint {target}: No space left on device$"):
        run.save(2048)
    monkeypatch.undo()
    assert checkpoint.latest(tmp_path) == checkpoint.training_dir(tmp_path, 1024)
    assert checkpoint.damage(checkpoint.training_dir(tmp_path, 1024)) is None


def trained_one_step(one: OneLearner) -> None:
    """One optimizer step, so the optimizer has a state (Adam: step, moments)."""
    batch, _, _ = one.shard.sample(4)
    loss, _, _ = one.agent(batch.to(next(one.agent.parameters()).device))
    loss.backward()
    for optimizer in one.optimizers.values():
        optimizer.step()


def optimizer_states(one: OneLearner) -> list[dict]:
    """Each parameter's state in each of the learner's optimizers."""
    return [state for optimizer in one.optimizers.values() for state in optimizer.state.values()]


def restored(tmp_path, device: torch.device) -> OneLearner:
    """A learner saved after one step, and another one on ``device`` restored from it."""
    one = OneLearner(tmp_path / "run")
    trained_one_step(one)
    one.save(1000)
    again = OneLearner(tmp_path / "again")
    again.agent.to(device)
    again.optimizers = again.agent.make_optimizers()
    checkpoint.restore_learner(checkpoint.latest(tmp_path / "run"), 0, again.agent, again.optimizers, device)
    return again


@needs_replay
def test_resume_puts_the_optimizer_state_where_torch_expects_it(tmp_path):
    again = restored(tmp_path, torch.device("cpu"))
    for state in optimizer_states(again):
        if "step" in state:  # Adam keeps its step count on the CPU unless fused or `capturable`
            assert state["step"].device.type == "cpu"
    trained_one_step(again)


@needs_replay
@pytest.mark.gpu
def test_resume_onto_a_gpu_puts_adams_step_where_torch_keeps_it_and_restores_the_gpus_generator(tmp_path):
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.cuda.manual_seed(123)
    expected = torch.rand(4, device=device)
    torch.cuda.manual_seed(123)
    again = restored(tmp_path, device)  # saved the GPU generator's state before drawing
    assert torch.equal(torch.rand(4, device=device), expected)
    for optimizer in again.optimizers.values():
        # Adam's step count stays on the CPU, unless fused or capturable (the recipes' Adam
        # is fused): then torch keeps it beside the parameters.
        on_gpu = any(group["fused"] or group["capturable"] for group in optimizer.param_groups)
        for state in optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value):
                    assert value.device.type == ("cpu" if key == "step" and not on_gpu else "cuda"), key
    trained_one_step(again)  # a step count on the wrong device fails Adam's step


@needs_replay
def test_only_the_newest_checkpoints_are_kept(tmp_path):
    run = OneLearner(tmp_path, keep=2)
    for frames in (1024, 2048, 3072):
        run.save(frames)
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["frames-000000002048", "frames-000000003072"]


def test_a_checkpoint_replaces_one_at_the_same_frame_count(tmp_path):
    """As when a resumed run is stopped before its first step: it checkpoints the same frame."""
    earlier = checkpoint.training_dir(tmp_path, 1024)
    earlier.mkdir(parents=True)
    (earlier / "stale").write_text("from before the resume")
    partial = checkpoint.partial_dir(earlier)
    partial.mkdir()
    (partial / checkpoint.META).write_text("{}")
    checkpoint.commit(partial, earlier, keep=2)
    assert sorted(p.name for p in earlier.iterdir()) == [checkpoint.META] and not partial.exists()


@needs_replay
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["env.id=Acrobot-v1"],
            "is a checkpoint of recipe '{recipe}' on CartPole-v1, not of '{recipe}' on Acrobot-v1",
        ),
        (["collector.frames_per_batch=128"], "was written with frames_per_batch=256, this run has 128"),
    ],
)
def test_a_checkpoint_that_does_not_fit_the_run_is_one_error_line(tmp_path, capsys, argv, message):
    run = OneLearner(tmp_path)
    if run.cfg.env.id != "CartPole-v1":
        pytest.skip("the messages name CartPole-v1")
    run.save(1024)
    assert train.main([*tiny_overrides(REPLAY_RECIPE), f"resume={tmp_path}", *argv, "--print-config"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message.format(recipe=REPLAY_RECIPE) in lines[0], lines


@needs_replay
def test_a_run_dir_holds_one_runs_checkpoints(tmp_path, capsys):
    """A fresh run into a run_dir with checkpoints, or a resume there from an older one, is
    one error line before anything starts, and the checkpoints stay as they were. Going on
    from the newest is accepted, and so is a resume from the older one into another run_dir;
    --help and --print-config still answer."""
    run = OneLearner(tmp_path)
    run.save(1024)
    run.save(2048)
    older = checkpoint.training_dir(tmp_path, 1024)
    overrides = [*tiny_overrides(REPLAY_RECIPE), f"run_dir={tmp_path}"]
    error = (
        f"error: run_dir {tmp_path} holds checkpoints up to frames-000000002048, which this run would not go "
        f"on from: resume={tmp_path} goes on from them; or choose another run_dir"
    )
    for resume in [[], [f"resume={older}"]]:
        assert train.main([*overrides, *resume]) == 2
        assert capsys.readouterr().err.strip() == error
    for resume in ["auto", str(tmp_path), str(checkpoint.training_dir(tmp_path, 2048))]:
        cfg = config.load([*overrides, f"resume={resume}"], train.DEFAULTS)
        checkpoint.check_run_dir(cfg, checkpoint.check_resume(cfg))
    cfg = config.load([*overrides, f"resume={older}", f"run_dir={tmp_path / 'branch'}"], train.DEFAULTS)
    checkpoint.check_run_dir(cfg, checkpoint.check_resume(cfg))
    assert train.main([*overrides, "--print-config"]) == 0 and train.main([*overrides, "--help"]) == 0
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "frames-000000001024",
        "frames-000000002048",
    ]


def test_resume_from_nothing_is_one_error_line(tmp_path, capsys):
    assert train.main([f"resume={tmp_path}", "--print-config"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: resume: no checkpoint at {tmp_path} (checkpoint.every=N, and a stop by a signal, write them)"
    )


SAME_RUN_LINE = (
    "(a run keeps its recipe, env, seed, algo and frames_per_batch; total_frames, eval, learners and the "
    "rest may change): choose another run_dir"
)


@needs_runtime_recipe
def test_a_run_dir_holds_one_run_and_refuses_another_configuration_in_one_line(tmp_path, capsys):
    """A run's records (config.yaml) name its configuration: another seed in the same run_dir
    is refused with exit code 2 (here in this process: the refusal comes before Fabric
    starts) and the records stay; the same run with other total_frames, eval, logging or
    learners is not."""
    recipe = RUNTIME_RECIPE
    run_dir = tmp_path / "run"
    overrides = [*tiny_overrides(recipe), "total_frames=512", "eval.episodes=2", f"run_dir={run_dir}"]
    read_summary(run_command([sys.executable, "train.py", *overrides]))
    records = {name: (run_dir / name).read_text() for name in ("config.yaml", "summary.json")}

    assert train.main([*overrides, "seed=1", "total_frames=1024"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: run_dir {run_dir} holds another run's records: seed 0 -> 1 {SAME_RUN_LINE}"
    ]
    assert records == {name: (run_dir / name).read_text() for name in records}

    changes = ["total_frames=4096", "eval.episodes=5", "eval.every=0", "log_every=512", "fabric.devices=2"]
    for resume in ([], ["resume=auto"]):
        cfg = config.load([*overrides, *changes, *resume], train.DEFAULTS)
        checkpoint.check_run_dir(cfg, checkpoint.check_resume(cfg))


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_longer_run_is_the_same_run_though_its_schedules_follow_total_frames(tmp_path, recipe):
    """Hyperparameters whose defaults follow total_frames (learning-rate decay, say) change
    with it when a resume extends a run; another seed is another run."""
    overrides = [f"recipe={recipe}", f"run_dir={tmp_path}"]
    OmegaConf.save(config.load([*overrides, "total_frames=1024"], train.DEFAULTS), tmp_path / "config.yaml")
    assert checkpoint.other_run(config.load([*overrides, "total_frames=4096"], train.DEFAULTS)) == []
    other_seed = config.load([*overrides, "total_frames=1024", "seed=5"], train.DEFAULTS)
    assert checkpoint.other_run(other_seed) == ["seed 0 -> 5"]


@needs_runtime_recipe
@pytest.mark.slow
def test_a_default_run_stopped_by_ctrl_c_goes_on_with_resume_auto_from_the_frame_it_stopped_at(tmp_path):
    """checkpoint.every at its default (none): the stop writes the checkpoint. Under `fabric
    run` Ctrl-C reaches the launcher, which passes it on to its ranks."""
    recipe = RUNTIME_RECIPE
    run_dir = tmp_path / "run"
    overrides = [*tiny_overrides(recipe), "resume=auto", f"run_dir={run_dir}"]
    stopped = launch(fabric_command(2, "train.py", *overrides, "total_frames=10000000"))
    deadline = time.monotonic() + 180
    while not logged_rows(run_dir):  # training: the first row comes after log_every frames
        assert stopped.poll() is None, stopped.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run logged nothing"
        time.sleep(0.2)
    os.killpg(stopped.pid, signal.SIGINT)  # Ctrl-C: the terminal's process group, fabric run's
    _, stderr = stopped.communicate(timeout=90)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGINT", stderr[-3000:]
    frames = summary["frames_collected"]
    assert 0 < frames < 10_000_000
    last = checkpoint.latest(run_dir)
    assert last == checkpoint.training_dir(run_dir, frames)
    updates = checkpoint.Meta.read(last).updates
    assert processes_of(run_dir) == {}

    # Another seed there is refused, and told how to branch from the checkpoint instead.
    cfg = config.load([*overrides, "seed=1"], train.DEFAULTS)
    branch = f"or resume={run_dir} run_dir=<another> to go on from its checkpoint"
    with pytest.raises(config.ConfigError, match=re.escape(branch)):
        checkpoint.check_run_dir(cfg, checkpoint.check_resume(cfg))

    # The same command goes on, here to 2 steps of 2 learners more (total_frames may change).
    resumed = run_command(fabric_command(2, "train.py", *overrides, f"total_frames={frames + 1024}"))
    summary = read_summary(resumed)
    assert f"resumed from {last} at frame {frames}, update {updates}" in resumed.stderr
    assert summary["resumed_from"] == str(last)
    assert summary["frames_collected"] == frames + 1024
    if recipes.load(recipe).Agent.uses_replay:
        assert summary["replay_size"] == frames + 1024  # the buffer came back whole
    assert len(set(summary["learner_param_checksums"].values())) == 1


@needs_runtime_recipe
@pytest.mark.slow
def test_a_run_killed_mid_training_goes_on_from_its_last_checkpoint(tmp_path):
    recipe = RUNTIME_RECIPE
    run_dir = tmp_path / "run"
    # 4608 frames: whole steps of 256 frames for 2 learners.
    overrides = [*tiny_overrides(recipe), "total_frames=4608", "checkpoint.every=1024", f"run_dir={run_dir}"]
    killed = launch(fabric_command(2, "train.py", *overrides))
    deadline = time.monotonic() + 180
    while not list((run_dir / "checkpoints").glob("frames-*/meta.json")):
        assert killed.poll() is None, killed.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.1)
    for pid in processes_of(run_dir):  # every rank, the replay process and the launcher, without warning
        os.kill(pid, signal.SIGKILL)
    killed.communicate(timeout=30)
    assert not (run_dir / "summary.json").exists(), "the run finished before it was killed"
    last = checkpoint.latest(run_dir)
    saved_at = checkpoint.Meta.read(last).frames
    assert saved_at < 4608

    resumed = run_command(fabric_command(2, "train.py", *overrides, f"resume={run_dir}"))
    summary = read_summary(resumed)
    assert summary["resumed_from"] == str(last)
    uses_replay = recipes.load(recipe).Agent.uses_replay
    restored = "; replay restored: " if uses_replay else ""
    assert f"resumed from {last} at frame {saved_at}, update " in resumed.stderr
    assert restored in resumed.stderr
    assert summary["frames_collected"] == 4608
    assert summary["replay_size"] == (4608 if uses_replay else 0)  # the buffer came back whole
    assert summary["updates"] == expected_updates(recipe, 2, frames=4608)
    assert len(set(summary["learner_param_checksums"].values())) == 1
    # The records go on too: the evaluations logged before the checkpoint are still there.
    evaluated = [row["frames"] for row in summary["eval_history"]]
    assert len(evaluated) == 2 and evaluated == sorted(evaluated)  # every 2048 frames, as in one run


@needs_replay
def test_a_checkpoint_without_replay_resumes_with_empty_shards_and_refills_them(tmp_path):
    """One process: the shard starts empty the same way in a replay process of its own."""
    run_dir = tmp_path / "run"
    overrides = [
        *tiny_overrides(REPLAY_RECIPE),
        "checkpoint.every=1024",
        "checkpoint.replay=false",
        f"run_dir={run_dir}",
    ]
    read_summary(run_command([sys.executable, "train.py", *overrides, "total_frames=2048"]))
    last = checkpoint.latest(run_dir)
    meta = checkpoint.Meta.read(last)
    assert not list(last.glob("replay-*")) and meta.replay is False

    resumed = run_command([sys.executable, "train.py", *overrides, "total_frames=4096", f"resume={run_dir}"])
    summary = read_summary(resumed)
    assert "replay not restored (saved with checkpoint.replay=false)" in resumed.stderr
    assert summary["replay_size"] == 2048  # only what the resumed run collected
    # No update until learning_starts (1024) more frames are in: the resumed run's steps of
    # 256 frames end at 2304, 2560, ..., 4096, and the last five make 4 updates each.
    assert summary["updates"] == meta.updates + 5 * 4
