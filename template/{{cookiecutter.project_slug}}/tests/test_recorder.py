"""Rank 0's records: the progress bar and the learning curve."""

from __future__ import annotations

import io
import math

from {{ cookiecutter.package_name }} import config, train
from {{ cookiecutter.package_name }}.distributed.topology import Topology
from {{ cookiecutter.package_name }}.recorder import Recorder, Window


def make_recorder(tmp_path, stream: io.StringIO, *overrides: str, learners: int = 1) -> Recorder:
    cfg = config.load([f"run_dir={tmp_path}", "total_frames=1000", *overrides], train.DEFAULTS)
    plan = Topology.plan(learners=learners, rank=0, replay_ranks=1, uses_replay=True)
    return Recorder(cfg, plan, progress_stream=stream)


def test_progress_bar_shows_frames_rates_and_returns(tmp_path):
    stream = io.StringIO()
    recorder = make_recorder(tmp_path, stream)
    recorder.report(512, {"frames_per_s": 1234.0, "updates_per_s": 56.0, "train_return": 21.5})
    recorder.report(512, {"eval_return": 99.0})
    recorder.progress.refresh()
    shown = stream.getvalue().split("\r")[-1]
    # 1000 frames round up to 4 collector steps of 256 frames.
    assert "512/1.02k" in shown, shown
    assert "frames/s=1234" in shown and "updates/s=56" in shown
    assert "return=21.5" in shown and "eval=99" in shown


def test_progress_bar_can_be_turned_off(tmp_path):
    stream = io.StringIO()
    recorder = make_recorder(tmp_path, stream, "progress=false")
    recorder.report(512, {"frames_per_s": 1.0})
    recorder.progress.refresh()
    assert stream.getvalue() == ""


def test_rows_of_one_step_pair_up_by_kind_whatever_order_they_arrive_in(tmp_path):
    """Two learners' training and evaluation rows of one step are separate RPCs: the second
    learner's training row can come after the first one's evaluation row."""
    recorder = make_recorder(tmp_path, io.StringIO(), "progress=false", learners=2)
    recorder.report(512, {"frames_per_s": 100.0, "train_return": 10.0})
    recorder.report(512, {"eval_return": 30.0})
    recorder.report(512, {"eval_return": 50.0})
    recorder.report(512, {"frames_per_s": 300.0, "train_return": math.nan, "loss": 2.0})
    assert [row["eval_return"] for row in recorder.eval_history] == [40.0]
    assert recorder.train_history == [(512, 10.0)]
    merged = {"frames_per_s": 400.0, "train_return": 10.0, "loss": 2.0, "eval_return": 40.0}
    assert recorder.latest == merged


def test_a_learners_window_averages_each_loss_over_the_updates_that_gave_it():
    window = Window()
    window.add_metrics({"loss_qvalue": 1.0, "loss_actor": -4.0})
    window.add_metrics({"loss_qvalue": 3.0})  # TD3: no actor loss where the actor does not learn
    row = window.flush({})
    assert row["loss_qvalue"] == 2.0 and row["loss_actor"] == -4.0
