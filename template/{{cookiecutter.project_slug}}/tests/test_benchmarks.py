"""The benchmark scripts run and print their figures (their numbers are not judged here)."""

from __future__ import annotations

import json
import os
import runpy
import sys
import time

import pytest
import torch

from {{ cookiecutter.package_name }} import recipes
from {{ cookiecutter.package_name }}.envs import family_of, make_env

from .conftest import PROJECT, RECIPES, fabric_launcher_env, free_port, run_command, tiny_overrides

# Settings the stragglers benchmark chooses itself.
IGNORED = {"recipe", "total_frames", "eval.every", "collector.sync_frac"}


def test_collection_benchmark_prints_a_table_and_a_json_line():
    command = ["benchmarks/collection.py", "--envs", "4", "--frames", "2048", "--rounds", "1"]
    command += ["--workers", "2"]
    result = run_command([sys.executable, *command])
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["benchmark"] == "collection"
    assert figures["plain_fps"] > 0 and figures["collector_fps"] > 0 and figures["torchrl_collector_fps"] > 0
    assert figures["workers_speedup"]["1"] == 1 and figures["workers_speedup"]["2"] > 0
    # This process's CPU time, and on Linux (/proc) the workers'. CPU time a frame (cores over
    # frames/s) hardly depends on the machine's load: the workers spend at least about what
    # one process spends on a frame, where this process alone spends little.
    used = figures["cores"]
    one_process = used["project collector"] / figures["collector_fps"]
    assert used["project collector, 2 workers"] / figures["workers_fps"]["2"] > 0.5 * one_process
    assert 0 < min(used.values()) and max(used.values()) < os.cpu_count() + 0.2
    assert "project collector, 2 workers" in result.stdout


def test_vector_envs_benchmark_prints_each_atari_backend():
    pytest.importorskip("ale_py", reason="needs the [atari] extra")
    options = ["--envs", "2", "--frames", "256", "--threads", "1", "--rounds", "1"]
    result = run_command([sys.executable, "benchmarks/vector_envs.py", *options], timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rates = json.loads(result.stdout.strip().splitlines()[-1])["fps"]
    assert {"ale, 1 threads", "async, a process a game"} <= set(rates) and min(rates.values()) > 0


def refusal(monkeypatch, capsys, script: str, *arguments: str) -> tuple[int | str, str, str]:
    """A benchmark script run in this process as python runs it (its folder first on the
    path), for a refusal: what it exits with (a string is the line python prints before it
    exits 1), its standard output and its error. In a process of its own, importing torch
    would take most of the test's time."""
    monkeypatch.setattr(sys, "argv", [script, *arguments])
    monkeypatch.syspath_prepend(str(PROJECT / "benchmarks"))
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(PROJECT / script), run_name="__main__")
    captured = capsys.readouterr()
    return exited.value.code, captured.out, captured.err


def test_learning_benchmark_wants_a_target_for_another_env(monkeypatch, capsys):
    recipe = RECIPES[0]
    env = "Acrobot-v1" if recipes.load(recipe).RUN_DEFAULTS["env"]["id"] != "Acrobot-v1" else "CartPole-v1"
    code, out, err = refusal(monkeypatch, capsys, "benchmarks/learning.py", "--recipe", recipe, "--env", env)
    assert code == 2 and out == ""
    assert "target return is for" in err and f"pass --target for {env}" in err


def learning_output(path, curves: list[dict[int, float]]) -> str:
    """A file as learning.py writes it (a table, then its JSON line), with these seeds' curves."""
    seeds = [{"seed": seed, "curve": {str(frames): value for frames, value in curve.items()}}
             for seed, curve in enumerate(curves, 1)]  # fmt: skip
    path.write_text("seed reached ...\n" + json.dumps({"benchmark": "learning", "seeds": seeds}) + "\n")
    return str(path)


def test_the_curves_benchmark_draws_each_setting_and_its_mean(tmp_path):
    one = learning_output(tmp_path / "one.log", [{100: 1.0, 200: 3.0}, {100: 3.0, 200: 5.0}])
    two = learning_output(tmp_path / "two.log", [{100: 2.0, 200: 2.0, 300: 9.0}])
    three = learning_output(tmp_path / "three.log", [{100: 4.0, 200: 6.0}])
    figure = tmp_path / "curves.png"
    command = [
        sys.executable,
        "benchmarks/curves.py",
        "--out",
        str(figure),
        f"a={one}",
        f"b={two}",
        f"b={three}",
    ]
    result = run_command(command, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    # Each label's mean at the frames all its seeds share: b's third point is one seed's only.
    assert json.loads(result.stdout.strip().splitlines()[-1])["means"] == {
        "a": [[100, 2.0], [200, 4.0]],
        "b": [[100, 3.0], [200, 4.0]],
    }
    assert figure.read_bytes().startswith(b"\x89PNG")

    (tmp_path / "broken.log").write_text("error: seed 1 failed\n")
    result = run_command([sys.executable, "benchmarks/curves.py", f"a={tmp_path / 'broken.log'}"], timeout=60)
    assert result.returncode == 1
    assert (
        result.stderr.strip() == f"error: {tmp_path / 'broken.log'} does not end with learning.py's JSON line"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the benchmark would run")
def test_the_gpu_benchmark_without_a_gpu_stops_in_one_line(monkeypatch, capsys):
    code, out, err = refusal(monkeypatch, capsys, "benchmarks/gpu.py", "--frames", "1000")
    assert (code, out, err) == ("error: benchmarks/gpu.py needs a CUDA device; torch sees none", "", "")


@pytest.mark.slow
def test_end_to_end_benchmark_compares_the_two_collector_modes(tiny):
    recipe, *overrides = (item for item in tiny if not item.startswith("total_frames="))
    command = [sys.executable, "benchmarks/end_to_end.py", "--recipe", recipe.removeprefix("recipe=")]
    result = run_command([*command, "--frames", "2048", "--learners", "1", *overrides])
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["benchmark"] == "end_to_end"
    one_process = figures["1_learners"]
    assert one_process["sync_train_s"] > 0 and one_process["async_train_s"] > 0
    assert one_process["async_updates_per_s"] > 0 and one_process["policy_lag"] > 0


@pytest.mark.slow
def test_scaling_benchmark_runs_one_and_two_learners_and_draws_them(tmp_path):
    # The first recipe on CartPole with tiny settings: 2 collector steps per learner, the
    # second with updates; the learner counts, the learning start and the frames are the
    # benchmark's own.
    recipe = RECIPES[0]
    ignored = {"recipe", "total_frames", "eval.every", "eval.episodes", "threads", "algo.learning_starts"}
    overrides = [item for item in tiny_overrides(recipe) if item.split("=")[0] not in ignored]
    figure = tmp_path / "scaling.png"
    command = [sys.executable, "benchmarks/scaling.py", "--recipes", recipe, "--learners", "1", "2"]
    command += ["--frames", "512", "--learning-starts", "256", "--out", str(figure), "env.id=CartPole-v1"]
    result = run_command([*command, *overrides], env=fabric_launcher_env())
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["benchmark"] == "scaling" and figures["axis"] == "learners" and figures["counts"] == [1, 2]
    runs = figures["recipes"][recipe]
    assert set(runs) == {"1", "2"}
    for learners, run in runs.items():
        assert run["env"] == "CartPole-v1" and run["frames"] == 512 * int(learners)
        assert run["frames_per_s"] > 0 and run["updates_per_s"] > 0 and run["updates"] > 0
        # Every millisecond of a step is in one column, "other" the untimed rest.
        groups = run["phase_groups_ms_per_step"]
        assert set(groups) == {"collect", "update", "replay", "agree", "other"}
        assert groups["collect"] > 0 and groups["update"] > 0 and groups["other"] >= 0
        assert sum(groups.values()) == pytest.approx(run["step_ms"])
    assert runs["1"]["efficiency"] == 1.0
    # speed.py's runs play no greedy episode (eval.episodes=0): none at the end either.
    run_dir = PROJECT / "runs" / "benchmarks" / f"scaling-{recipe}-2-learners"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["eval_return"], summary["eval_episodes"], summary["eval_history"]) == (None, 0, [])
    assert "evaluate" not in summary["phase_ms_per_step"]
    with (run_dir / "metrics.csv").open() as file:
        assert "eval_return" not in file.readline().strip().split(",")
    two = runs["2"]
    assert two["efficiency"] == pytest.approx(two["frames_per_s"] / (2 * runs["1"]["frames_per_s"]))
    # The table: a header and one row per run, above the figure's line and the JSON line.
    lines = result.stdout.strip().splitlines()
    assert lines[0].split()[:3] == ["recipe", "env", "learners"]
    assert [line.split()[:3] for line in lines[1:3]] == [[recipe, "CartPole-v1", str(n)] for n in (1, 2)]
    assert lines[3] == f"figure: {figure}"
    assert figure.read_bytes().startswith(b"\x89PNG") and figure.stat().st_size > 10_000


def test_the_scaling_benchmark_refuses_a_count_of_no_learners(monkeypatch, capsys):
    code, out, err = refusal(monkeypatch, capsys, "benchmarks/scaling.py", "--learners", "0", "1")
    assert code == 2 and out == ""
    assert err.strip().splitlines()[-1].endswith("--learners: counts must be at least 1, got 0")


@pytest.mark.slow
def test_replay_benchmark_measures_rpc_on_atari_frames_against_in_process():
    """Uniform shards (alpha 0; the prioritized ones are in every replay run's tests), two of
    them, frames over shared memory and over the socket."""
    pytest.importorskip("ale_py", reason="needs the [atari] extra")
    command = [sys.executable, "benchmarks/replay.py", "--atari", "--learners", "1", "--shards", "2"]
    result = run_command([*command, "--alpha", "0", "--seconds", "0.5", "--atari-batches", "2"])
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["atari"] and figures["alpha"] == 0 and figures["shards"] == 2
    rows = figures["rows"]
    over_rpc = [f"rpc, 2 shard(s), 1 learner(s), {path}" for path in ("shared memory", "socket")]
    assert set(rows) == {"in-process, before", *over_rpc, "in-process, after"}
    assert all(row["extends_per_s"] > 0 and row["samples_per_s"] > 0 for row in rows.values())
    # One uint8 84x84 frame per transition, plus its row: far below both stacks' 56 KB.
    assert 7056 < figures["bytes_per_transition"] < 7500 < 56448 < figures["naive_bytes_per_transition"]


@pytest.mark.slow
def test_resume_benchmark_compares_one_run_with_a_resumed_one(tiny):
    recipe, *overrides = (
        item.removeprefix("recipe=") for item in tiny if not item.startswith("total_frames=")
    )
    command = [sys.executable, "benchmarks/resume.py", "--recipe", recipe, "--frames", "2048"]
    command += ["--devices", "1", "--main-port", str(free_port()), *overrides]
    result = run_command(command)
    assert result.returncode == 0, result.stderr[-2000:]
    (seed,) = json.loads(result.stdout.strip().splitlines()[-1])["seeds"]
    assert seed["one_run"]["frames"] == seed["resumed"]["frames"] == 2048
    # The resumed run also keeps the final evaluation of its first leg, at 1024 frames.
    assert set(seed["resumed_curve"]) == set(seed["one_run_curve"]) | {"1024"}


@pytest.mark.slow
def test_stragglers_benchmark_compares_lockstep_with_the_threshold():
    on_policy = [name for name in RECIPES if not recipes.load(name).Agent.uses_replay]
    if not on_policy:
        pytest.skip("this project has no on-policy recipe")
    overrides = [item for item in tiny_overrides(on_policy[0]) if item.split("=")[0] not in IGNORED]
    command = [sys.executable, "benchmarks/stragglers.py", "--frames", "1536", "--step-ms", "1"]
    command += ["--main-port", str(free_port()), *overrides]
    result = run_command(command)
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["benchmark"] == "stragglers"
    lockstep, threshold = figures["throughput"]["sync_frac=1"], figures["throughput"]["sync_frac=0.6"]
    # sync_frac=1 with a straggler: everyone waits for it, nothing is cut (the lockstep that
    # every other PPO test runs, there without a straggler).
    assert lockstep["frames"] == 1536
    assert all(row["cut"] == 0 and row["mean_fraction"] == 1.0 for row in lockstep["rollouts"].values())
    assert threshold["frames"] >= 1536 and threshold["rollouts"]["2"]["cut"] > 0


def test_the_stragglers_pixel_env_is_the_minatar_game_with_a_simulator_cost(monkeypatch):
    """``stragglers.py --env MinAtar/Breakout-v1``: the ranks step the same game, with the
    MinAtar family's defaults, each step costing the simulated time."""
    pytest.importorskip("minatar", reason="needs the [minatar] extra")
    from benchmarks import stragglers

    stragglers.register("MinAtar/Breakout-v1")
    env_id = "benchmarks.stragglers:MinAtar/StragglerBreakout-v1"
    assert family_of(env_id) == "minatar"
    monkeypatch.setenv("SIMULATOR_STEP_S", "0.005")
    simulated, plain = make_env(env_id, 2, seed=3), make_env("MinAtar/Breakout-v1", 2, seed=3)
    torch.manual_seed(0)
    started = time.perf_counter()
    steps = simulated.rollout(5, break_when_any_done=False)
    assert time.perf_counter() - started >= 5 * 2 * 0.005
    actions = steps["action"]
    replay = plain.reset()
    for step in range(5):
        replay["action"] = actions[:, step]
        replay = plain.step(replay)
        assert torch.equal(replay["next", "observation"], steps["next", "observation"][:, step])
        replay = replay["next"]
    assert steps["observation"].dtype == torch.uint8 and steps["observation"].shape[-3:] == (4, 10, 10)
