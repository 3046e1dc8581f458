"""evaluate.py: greedy returns of a saved agent, their JSON record, and videos."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from {{ cookiecutter.package_name }} import checkpoint, config, evaluate, evaluation, recipes, train


@pytest.fixture
def run_dir(tmp_path):
    cfg = config.load([f"run_dir={tmp_path}", "algo.hidden_sizes=[16]"], train.DEFAULTS)
    agent = recipes.make_agent(recipes.load(cfg.recipe), cfg.algo, cfg.env, 2)
    checkpoint.save_agent(tmp_path / checkpoint.FINAL, cfg, agent)
    return tmp_path


def test_evaluate_prints_and_records_mean_and_spread(run_dir, capsys):
    assert evaluate.main([f"checkpoint={run_dir}", "episodes=5", "seed=3"]) == 0
    record = json.loads((run_dir / "evaluation.json").read_text())
    assert record["episodes"] == len(record["returns"]) == 5
    assert record["mean_return"] == pytest.approx(statistics.fmean(record["returns"]))
    assert record["std_return"] == pytest.approx(statistics.pstdev(record["returns"]))
    assert all(value != 0 for value in record["returns"])  # the episodes were played
    assert "over 5 episodes" in capsys.readouterr().out


def test_evaluating_leaves_the_training_random_numbers_as_they_were():
    """How often a run evaluates does not change what it learns: greedy episodes on new env
    copies draw nothing from torch's generator that training would see."""
    cfg = config.load(["algo.hidden_sizes=[16]"], train.DEFAULTS)
    agent = recipes.make_agent(recipes.load(cfg.recipe), cfg.algo, cfg.env, 2)
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    returns = evaluation.evaluate(agent.policy, cfg.env, 2, seed=1000, device=torch.device("cpu"))
    assert len(returns) == 2
    assert torch.equal(torch.random.get_rng_state(), before)


def test_video_records_one_file_per_episode(run_dir):
    file = run_dir / checkpoint.FINAL
    assert evaluate.main([f"checkpoint={file}", "episodes=2", "video=true"]) == 0
    videos = sorted((run_dir / "videos").glob("*.mp4"))
    assert len(videos) == 2 and all(video.stat().st_size > 0 for video in videos)
    assert json.loads((run_dir / "evaluation.json").read_text())["episodes"] == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["checkpoint=/nonexistent"], "no checkpoint at /nonexistent"),
        (["episodes=3"], "usage: python evaluate.py"),
        (["checkpoint=x", "episodes=0"], "episodes must be > 0, got 0"),
        (["checkpoint=x", "frames=3"], "frames"),
    ],
)
def test_bad_input_is_one_error_line(argv, message, capsys):
    assert evaluate.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


# Each text trips torch's unpickler differently: a KeyError; an IndexError, as a run's metrics.csv does.
@pytest.mark.parametrize("text", ["not a checkpoint", "eval_return,frames_per_s\n"])
def test_a_file_that_is_not_a_checkpoint_is_one_error_line(tmp_path, capsys, text):
    (tmp_path / "final.pt").write_text(text)
    assert evaluate.main([f"checkpoint={tmp_path / 'final.pt'}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "not an agent train.py saved" in lines[0], lines
