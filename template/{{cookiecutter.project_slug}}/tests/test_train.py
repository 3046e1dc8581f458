"""The real entry point: one process, and several ranks launched by Fabric and by `fabric run`."""

from __future__ import annotations

import csv
import json
import math
import socket
import subprocess
import sys

import pytest
import torch
from lightning_fabric.plugins.precision import MixedPrecision
from omegaconf import OmegaConf

from {{ cookiecutter.package_name }} import checkpoint, config, evaluate, recipes, train
from {{ cookiecutter.package_name }}.distributed.topology import cpus_per_rank

from .conftest import (
    PROJECT,
    RECIPES,
    REPLAY_RECIPE,
    command_env,
    expected_updates,
    fabric_command,
    free_port,
    learners_run,
    read_summary,
    replay_items,
    replays_sequences,
    run_command,
    tiny_overrides,
)


def one_process_run(run_dir, recipe: str, *extra: str) -> dict:
    """A tiny one-process run of ``recipe``, seed 3, with both file loggers; its summary."""
    overrides = [*tiny_overrides(recipe), "seed=3", "loggers=[csv,tensorboard]", f"run_dir={run_dir}", *extra]
    return read_summary(run_command([sys.executable, "train.py", *overrides]))


@pytest.fixture(scope="module")
def one_process_runs(tmp_path_factory):
    """recipe -> (run_dir, summary) of ``one_process_run``, each run once for this module."""
    runs = {}

    def get(recipe: str):
        if recipe not in runs:
            run_dir = tmp_path_factory.mktemp(recipe) / "run"
            runs[recipe] = run_dir, one_process_run(run_dir, recipe)
        return runs[recipe]

    return get


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipe_trains_in_one_process_and_writes_its_records(one_process_runs, recipe):
    run_dir, summary = one_process_runs(recipe)
    assert summary["world_size"] == 1 and summary["roles"] == {"0": "learner"}
    assert summary["frames_collected"] == 3072
    uses_replay = recipes.load(recipe).Agent.uses_replay
    assert summary["replay_size"] == (replay_items(recipe, 3072) if uses_replay else 0)
    assert summary["updates"] == expected_updates(recipe, learners=1)
    assert summary["eval_episodes"] >= 10 and math.isfinite(summary["eval_return"])
    assert [row["frames"] for row in summary["eval_history"]] == [2048]
    assert (run_dir / "config.yaml").is_file() and (run_dir / "metrics.csv").is_file()
    # The record is the config the run resolved: env.threads, the one rank's share of the
    # cores (threads=1 is torch's alone).
    assert OmegaConf.load(run_dir / "config.yaml").env.threads == cpus_per_rank(1)
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 1
    assert summary["checkpoint"] == str(run_dir / "checkpoints" / "final.pt")
    assert (run_dir / "checkpoints" / "final.pt").is_file()
    assert (run_dir / "learning_curve.png").read_bytes().startswith(b"\x89PNG")
    # The trained agent loads into a fresh one and plays.
    assert evaluate.main([f"checkpoint={run_dir}", "episodes=2"]) == 0
    assert json.loads((run_dir / "evaluation.json").read_text())["episodes"] == 2


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_phases_of_a_step_add_up_to_its_wall_time(one_process_runs, recipe):
    """timing.py: each phase's milliseconds per step, in the summary and the metrics; the
    phases together are the training time, within a few percent (the loop's own Python
    between them)."""
    run_dir, summary = one_process_runs(recipe)
    phases = summary["phase_ms_per_step"]
    expected = {"collect", "agree", "after_collect", "forward", "backward", "optimizer", "evaluate", "report"}
    expected |= (
        {"replay_insert", "sample_wait", "priority_update"}
        if recipes.load(recipe).Agent.uses_replay
        else {"shuffle"}
    )
    assert expected <= set(phases) and all(ms >= 0 for ms in phases.values())
    assert phases["collect"] > 0 and phases["forward"] > 0 and phases["backward"] > 0
    steps = 3072 // 256
    assert sum(phases.values()) * steps / 1000 == pytest.approx(
        summary["train_s"] * summary["phase_accounted"]
    )
    assert 0.93 <= summary["phase_accounted"] <= 1.0
    with (run_dir / "metrics.csv").open() as file:
        header = file.readline().strip().split(",")
    assert {f"ms_per_step/{name}" for name in ("collect", "forward", "backward")} <= set(header)


def test_a_run_shorter_than_log_every_records_its_metrics_and_its_checkpoint_plays(tmp_path):
    run_dir = tmp_path / "run"
    short = ["total_frames=512", "log_every=100000", "eval.every=0", "checkpoint.every=256"]
    command = [sys.executable, "train.py", *tiny_overrides(RECIPES[0]), *short, f"run_dir={run_dir}"]
    summary = read_summary(run_command(command))
    with (run_dir / "metrics.csv").open(newline="") as file:
        rows = list(csv.DictReader(file))
    # One row of the learner's metrics and one of the final evaluation, both at the end.
    assert [int(row["step"]) for row in rows] == [512, 512]
    assert float(rows[0]["frames_per_s"]) > 0 and rows[0]["train_return"] != ""
    assert float(rows[1]["eval_return"]) == pytest.approx(summary["eval_return"])

    # evaluate.py takes a training checkpoint folder as well as the run and final.pt.
    folder = run_dir / "checkpoints" / "frames-000000000512"
    state, _ = checkpoint.load(checkpoint.locate(str(folder)))
    final, _ = checkpoint.load(run_dir / checkpoint.FINAL)
    assert state["algo"] == final["algo"] and state["agent"].keys() == final["agent"].keys()
    assert all(torch.equal(state["agent"][key], final["agent"][key]) for key in final["agent"])
    assert evaluate.main([f"checkpoint={folder}", "episodes=2"]) == 0
    record = json.loads((run_dir / "evaluation.json").read_text())
    assert record["checkpoint"] == str(folder) and record["episodes"] == 2


# A recipe that replays sequences runs on three learners and two replay processes in its
# own tests (test_r2d2.py), which check all this test does of it.
TRANSITIONS = [name for name in RECIPES if not replays_sequences(name)]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", TRANSITIONS)
def test_each_recipe_trains_on_two_learner_ranks(tmp_path, recipe):
    """Launched by Fabric itself (`python train.py fabric.devices=2`; the tests of faults,
    checkpoints and stragglers run `fabric run`). The first replay recipe collects
    asynchronously: the replay ratio holds and the policy lag is reported."""
    collect_async = recipe == REPLAY_RECIPE
    overrides = ["collector.mode=async", "collector.weight_sync_every=2"] if collect_async else []
    result = learners_run(2, *tiny_overrides(recipe), *overrides, f"run_dir={tmp_path}")
    summary = read_summary(result)
    if recipes.load(recipe).Agent.uses_replay:  # and rank 0 starts a replay process beside them
        roles, replay_size = {"0": "learner", "1": "learner", "2": "replay"}, replay_items(recipe, 3072, 2)
    else:
        roles, replay_size = {"0": "learner", "1": "learner"}, 0
    assert summary["roles"] == roles
    assert summary["frames_collected"] == 3072 and summary["replay_size"] == replay_size
    updates = expected_updates(recipe, 2)
    assert summary["updates"] == updates
    checksums = list(summary["learner_param_checksums"].values())
    assert len(checksums) == 2 and len(set(checksums)) == 1  # the learners stayed identical
    if collect_async:
        assert summary["collector_mode"] == "async"
        # As many samples per inserted frame as sync mode: each update's batch dealt out
        # over the two learners (learners.batch_size_of=run), for 3072 frames.
        batch_size = recipes.load(recipe).Config().batch_size
        assert summary["samples_per_insert"] == pytest.approx(updates * batch_size / 3072)
        # A batch is collected while the learner trains on the one before it (2 x 4 updates),
        # with weights pushed every 2 updates: its frames are at most 8 + 2 - 1 updates old.
        assert 0 < summary["policy_lag"] <= 9
    assert summary["eval_episodes"] >= 10 and math.isfinite(summary["eval_return"])
    # Rank 0 logs with its rank in front; the others keep their information to themselves.
    assert "[rank 0] INFO lightning_fabric" in result.stderr, result.stderr[-3000:]
    assert "GLOBAL_RANK: 1" not in result.stderr


# A recipe that replays sequences (R2D2's LSTM, stepped through each sequence) compiles
# for minutes on 2 CPU cores: 156 s in one process of 1,536 frames; three learners and a
# resume ran past the run's 300 s. Its runs here are eager.
COMPILED = TRANSITIONS
# Each rank compiles on its own, which is most of a compiled run's time here: three learners
# and a resume for one recipe (the first transition replay recipe, collecting with worker
# processes), one process for each of the others.
ON_THREE_LEARNERS = sorted(COMPILED, key=lambda name: name != REPLAY_RECIPE)[:1]
IN_ONE_PROCESS = [name for name in COMPILED if name not in ON_THREE_LEARNERS]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ON_THREE_LEARNERS)
def test_a_compiled_loss_trains_on_three_learners_and_resumes_on_one(tmp_path, monkeypatch, recipe):
    """compile=true: torch.compile around DDP keeps the learners identical, compiles the
    loss once for each update path and never again, times its compiling apart, and its
    checkpoints resume on another layout, compiled anew. The first replay recipe collects
    with two worker processes per learner (collector.workers=2), asynchronously on three
    learners and in sync mode on one: the frames stay exact and the learners identical."""
    monkeypatch.setenv("TORCH_LOGS", "recompiles")  # each compile after a learner's first
    # TD3's loss has two update paths (with and without the actor's loss), the others one.
    recompiles = 1 if hasattr(recipes.load(recipe).Agent, "update_path") else 0
    run_dir = tmp_path / "run"
    workers = ["collector.workers=2"] if recipe == REPLAY_RECIPE else []
    compiled = [*tiny_overrides(recipe), "compile=true", *workers, f"run_dir={run_dir}"]
    collect_async = ["collector.mode=async"] if workers else []
    result = learners_run(3, *compiled, *collect_async, "total_frames=1536", "checkpoint.every=1536")
    first = read_summary(result)
    assert first["collector_mode"] == ("async" if workers else "sync")
    assert result.stderr.count("Recompiling function") == 3 * recompiles, result.stderr[-3000:]
    assert first["frames_collected"] == 1536
    assert first["updates"] == expected_updates(recipe, 3, frames=1536)
    assert len(set(first["learner_param_checksums"].values())) == 1
    assert first["compile_s"] > 0 and first["phase_ms_per_step"]["compile"] > 0

    command = [sys.executable, "train.py", *compiled, "total_frames=3072", "resume=auto"]
    result = run_command(command)
    resumed = read_summary(result)
    assert result.stderr.count("Recompiling function") == recompiles, result.stderr[-3000:]
    assert resumed["resumed_from"] == str(run_dir / "checkpoints" / "frames-000000001536")
    assert resumed["frames_collected"] == 3072 and resumed["updates"] > first["updates"]
    assert resumed["compile_s"] > 0 and math.isfinite(resumed["eval_return"])


@pytest.mark.slow
@pytest.mark.parametrize("recipe", IN_ONE_PROCESS)
def test_each_recipe_compiles_its_loss_once_for_each_update_path(tmp_path, monkeypatch, recipe):
    """compile=true in one process: the recipe's loss compiles once for each update path
    and never again, its compiling timed apart, and the run trains to its end."""
    monkeypatch.setenv("TORCH_LOGS", "recompiles")
    recompiles = 1 if hasattr(recipes.load(recipe).Agent, "update_path") else 0
    compiled = [*tiny_overrides(recipe), "compile=true", "total_frames=1536", f"run_dir={tmp_path}"]
    result = run_command([sys.executable, "train.py", *compiled])
    summary = read_summary(result)
    assert result.stderr.count("Recompiling function") == recompiles, result.stderr[-3000:]
    assert summary["frames_collected"] == 1536
    assert summary["updates"] == expected_updates(recipe, 1, frames=1536)
    assert summary["compile_s"] > 0 and summary["phase_ms_per_step"]["compile"] > 0
    assert math.isfinite(summary["eval_return"])


@pytest.mark.gpu
@pytest.mark.parametrize("policy_device", ["cpu", "learner"])
def test_single_process_run_on_a_gpu(tmp_path, tiny, policy_device):
    """On the GPU learner, the collector acting with a CPU copy of the policy or with the
    learner's own on the GPU."""
    command = [
        sys.executable,
        "train.py",
        "fabric.accelerator=cuda",
        f"collector.policy_device={policy_device}",
        *tiny,
        f"run_dir={tmp_path / 'run'}",
    ]
    summary = read_summary(run_command(command))
    assert summary["frames_collected"] == summary["replay_size"] == 3072


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipes_update_holds_under_bf16_mixed_precision(recipe):
    """fabric.precision=bf16-mixed: the autocast Fabric puts around a learner's loss (its
    MixedPrecision plugin's; bfloat16 on the CPU) around the recipe's first update, checked
    as train.py checks it before a run trains; the weights stay finite. The recipe's own
    code is what differs from one recipe to another; one run under it is the next test."""
    cfg = config.load([f"recipe={recipe}", "fabric.precision=bf16-mixed"], train.DEFAULTS)
    with MixedPrecision(cfg.fabric.precision, "cpu").forward_context():
        agent = recipes.check_update(recipe, recipes.load(recipe), cfg.algo, cfg.env, cfg.seed)
    assert all(torch.isfinite(parameter).all() for parameter in agent.parameters())


def test_a_run_trains_under_bf16_mixed_precision(tmp_path):
    """fabric.precision=bf16-mixed on the CPU: Fabric's autocast around the learner's loss,
    whose priorities may come back in bfloat16 where the recipe replays; the run trains to its
    end with finite weights."""
    recipe = RECIPES[0]
    overrides = [*tiny_overrides(recipe), "fabric.precision=bf16-mixed", f"run_dir={tmp_path}"]
    result = run_command([sys.executable, "train.py", *overrides])
    summary = read_summary(result)
    assert "Using bfloat16 Automatic Mixed Precision" in result.stderr
    assert summary["updates"] == expected_updates(recipe, learners=1)
    assert math.isfinite(summary["eval_return"])
    assert all(math.isfinite(value) for value in summary["learner_param_checksums"].values())


# A recipe with memory is refused with cudagraphs=true (recipes.check_graphable).
GRAPHED = TRANSITIONS


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", GRAPHED)
def test_each_recipe_trains_with_cuda_graphs_in_bf16(tmp_path, recipe):
    """cudagraphs=true: after the first calls of each graph, every update's forward and
    backward is a replay (phase "graph"); with bf16-mixed precision too."""
    overrides = [
        *tiny_overrides(recipe),
        "fabric.accelerator=cuda",
        "cudagraphs=true",
        "fabric.precision=bf16-mixed",
        f"run_dir={tmp_path}",
    ]
    summary = read_summary(run_command([sys.executable, "train.py", *overrides]))
    phases = summary["phase_ms_per_step"]
    assert phases["graph"] > 0 and "forward" not in phases and "backward" not in phases
    assert summary["updates"] == expected_updates(recipe, learners=1)
    assert math.isfinite(summary["eval_return"])
    assert all(math.isfinite(value) for value in summary["learner_param_checksums"].values())


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", GRAPHED)
def test_each_recipe_trains_on_two_learners_sharing_a_gpu_with_cuda_graphs(tmp_path, recipe):
    """learners.share_gpu=true: two learners on GPU 0, gloo between them. With
    cudagraphs=true each replays its own graphs and one all-reduce averages the gradients:
    the frames stay exact, the updates are replays, and the learners stay identical."""
    shared = ["fabric.accelerator=cuda", "learners.share_gpu=true", "cudagraphs=true"]
    overrides = [*tiny_overrides(recipe), *shared, f"run_dir={tmp_path}"]
    summary = read_summary(learners_run(2, *overrides))
    assert summary["frames_collected"] == 3072
    assert summary["updates"] == expected_updates(recipe, 2)
    phases = summary["phase_ms_per_step"]
    assert phases["graph"] > 0 and "forward" not in phases and "backward" not in phases
    checksums = list(summary["learner_param_checksums"].values())
    assert len(checksums) == 2 and len(set(checksums)) == 1 and math.isfinite(checksums[0])


@pytest.mark.gpu
def test_gpu_learners_checkpoint_and_resume_on_another_number_of_them(tmp_path, tiny):
    """The multi-learner GPU path on one GPU: two learners with DDP over CUDA tensors, replay
    processes serving GPU learners, a checkpoint written by GPU learners; resumed by three
    learners with CUDA graphs, which stay identical, to the exact frames."""
    run_dir = tmp_path / "run"
    shared = [*tiny, "fabric.accelerator=cuda", "learners.share_gpu=true", f"run_dir={run_dir}"]
    first = read_summary(learners_run(2, *shared, "total_frames=1536", "checkpoint.every=1536"))
    assert first["frames_collected"] == 1536
    assert len(set(first["learner_param_checksums"].values())) == 1
    resumed = read_summary(learners_run(3, *shared, "cudagraphs=true", "total_frames=3840", "resume=auto"))
    assert resumed["resumed_from"] == str(run_dir / "checkpoints" / "frames-000000001536")
    assert resumed["frames_collected"] == 3840 and resumed["updates"] > first["updates"]
    checksums = list(resumed["learner_param_checksums"].values())
    assert len(checksums) == 3 and len(set(checksums)) == 1 and math.isfinite(checksums[0])


def check_two_learner_summary(summary: dict) -> None:
    assert summary["world_size"] == 3
    assert summary["roles"] == {"0": "learner", "1": "learner", "2": "replay"}
    # 3072 frames over two learners of 256 frames per step: 6 steps each, nothing lost.
    assert summary["frames_collected"] == 3072
    assert summary["replay_size"] == summary["frames_collected"]
    assert summary["stale_priority_updates"] == 0  # capacity exceeds the frames: nothing overwritten
    # Updates start once 1024 frames are in (step 2 of 6): 5 steps of 2 x 4 updates each
    # (learners.batch_size_of=run: the run's 4 per 256 frames).
    assert summary["updates"] == 40
    checksums = list(summary["learner_param_checksums"].values())
    assert len(checksums) == 2 and checksums[0] == checksums[1]
    assert summary["eval_episodes"] >= 10 and math.isfinite(summary["eval_return"])
    for key in ("frames_per_s", "updates_per_s", "wall_s"):
        assert summary[key] > 0
    assert [row["frames"] for row in summary["eval_history"]] == [2048]


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_collector_acting_with_a_cpu_copy_of_the_policy_collects_what_the_policy_would(
    tmp_path, one_process_runs, recipe
):
    """collector.policy_device=cpu (a GPU learner's default): the collector acts with a copy
    of the policy, weights and buffers (DQN's epsilon) refreshed before each batch. On the
    CPU that run is the run with the learner's own policy; a copy left stale would collect
    other frames and train other weights. It also shows sync collection reproducible: two
    processes of one seed train the same weights."""
    _, own = one_process_runs(recipe)
    copied = one_process_run(tmp_path, recipe, "collector.policy_device=cpu")
    assert copied["learner_param_checksums"] == own["learner_param_checksums"]
    assert copied["eval_return"] == own["eval_return"]


@pytest.mark.slow
def test_two_nodes_on_localhost(tmp_path, tiny):
    """The multi-node command shape: one launcher per node, node ranks 0 and 1, one main
    address and port (here both nodes are this machine). A learner per node; the replay
    process is on the first node, and the second node's learner reaches it over RPC. With
    no `rpc.port`, RPC and the watchdog serve on ports rank 0 picks and tells the other
    node's learner; the port after the main port, taken here, is not theirs."""
    main_port = free_port()
    taken = socket.create_server(("127.0.0.1", main_port + 1))
    launchers = [
        subprocess.Popen(
            fabric_command(
                1,
                *("--num-nodes", "2", "--node-rank", str(node), "--main-address", "127.0.0.1"),
                *("train.py", *tiny, f"run_dir={tmp_path / 'run'}"),
                main_port=main_port,
            ),
            cwd=PROJECT,
            env=command_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    try:
        outputs = [launcher.communicate(timeout=300) for launcher in launchers]
    finally:
        for launcher in launchers:
            launcher.kill()  # a no-op once it has exited
        taken.close()
    assert [launcher.returncode for launcher in launchers] == [0, 0], outputs[1][1][-3000:]
    summary = read_summary(subprocess.CompletedProcess([], 0, *outputs[0]))
    check_two_learner_summary(summary)
