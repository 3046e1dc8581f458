"""Chaos benchmark: does a run heal itself when its processes are killed at random?

    python benchmarks/chaos.py                         # 10 kills, 3 undisturbed seeds
    python benchmarks/chaos.py --kills 3 --frames 30000 --schedule 4 --quiet-seeds 1

One command, run under ``torchrun --max-restarts=KILLS``: 3 learners, a checkpoint every
``--every`` frames and ``resume=auto``; for a replay recipe also 2 replay processes and a
collector process beside each learner (``collector.mode=async``). The benchmark runs it undisturbed once per
``--quiet-seeds`` seed, then once more (seed ``--seed``) while it SIGKILLs a process of
the run ``--kills`` times: each time it waits until the current attempt's processes are
all up, then a random while, then kills a random learner, replay process or collector
process. ``--schedule`` seeds those draws, so a failing schedule can be replayed.

It checks what a healed run must show: exit 0, ``total_frames`` collected exactly, each
restart costing at most ``--every`` frames, a replay holding every collected transition
once (a sequence recipe's: no more sequences than an undisturbed run's), identical
learners, no process of any attempt left running and nothing of the run
left in /dev/shm. Prints each kill, a table, and, last, one JSON line. Exits 1 if a check
failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT))

from omegaconf import OmegaConf  # noqa: E402

from {{ cookiecutter.package_name }} import config, recipes  # noqa: E402

LEARNERS = 3
REPLAY_PROCESSES = 2
SHM = Path("/dev/shm")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def command(args: argparse.Namespace, seed: int, run_dir: Path) -> list[str]:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    return [
        torchrun,
        f"--max-restarts={args.kills}",
        *("--nnodes=1", f"--nproc-per-node={LEARNERS}", "--rdzv-backend=c10d"),
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "train.py",
        f"recipe={args.recipe}",
        f"total_frames={args.frames}",
        f"seed={seed}",
        *replay_settings(args),
        f"checkpoint.every={args.every}",
        # summary.json counts a failure's lost frames from the metrics rows the attempt wrote
        f"log_every={args.every // 4}",
        "resume=auto",
        "fabric.accelerator=cpu",
        "fabric.strategy=ddp",
        f"run_dir={run_dir}",
        *args.overrides,
    ]


def uses_replay(args: argparse.Namespace) -> bool:
    return recipes.load(args.recipe).Agent.uses_replay


def replay_holds_each_frame_once(
    args: argparse.Namespace, written: Path, planned: int, size: int | None
) -> bool:
    """Transitions: one item per frame collected. Sequences (a Config with a
    ``sequence_length``): none beyond an undisturbed run's, whose count follows from each env
    copy's steps, and fewer after restarts, which drop the steps that waited for a
    sequence's end (a resumed run starts new episodes)."""
    if not uses_replay(args):
        return size == 0
    if not written.is_file():
        return False
    cfg = OmegaConf.load(written)
    if "sequence_length" not in cfg.algo:
        return size == planned
    copies = cfg.env.num_envs * LEARNERS
    length, stride = cfg.algo.sequence_length, cfg.algo.sequence_length - cfg.algo.overlap
    steps = planned // copies
    return size is not None and 0 < size <= copies * max(0, (steps - length) // stride + 1)


def replay_settings(args: argparse.Namespace) -> list[str]:
    if not uses_replay(args):
        return []
    return [
        "collector.mode=async",
        f"replay.processes={REPLAY_PROCESSES}",
        f"replay.capacity={2 * args.frames}",  # room for every transition: the replay check counts them
    ]


def parent_of(pid: int) -> int:
    return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])


def rank_of(pid: int) -> int | None:
    for item in (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0"):
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def alive(pid: int) -> bool:
    """Running, and not a zombie its parent has yet to reap."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def processes(launcher: int) -> dict[str, list[int]]:
    """The run's processes under torchrun's agent ``launcher``: its workers (the learners),
    the replay processes rank 0 starts, and each learner's collector process."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and alive(int(entry.name)):
            try:
                children.setdefault(parent_of(int(entry.name)), []).append(int(entry.name))
            except (OSError, IndexError):
                continue
    found: dict[str, list[int]] = {"learner": [], "replay": [], "collector": []}
    for learner in children.get(launcher, []):
        found["learner"].append(learner)
        for child in children.get(learner, []):
            words = command_line(child)
            if "--learners" in words:
                found["replay"].append(child)
            elif "forkserver" in words:
                # The learner's fork server forks its collector processes (its imports run other
                # Pythons of their own: mujoco's glfw asks one for its library's version).
                forked = [pid for pid in children.get(child, []) if "forkserver" in command_line(pid)]
                found["collector"] += forked
    return found


def command_line(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_text()
    except OSError:
        return ""


def run(args: argparse.Namespace, seed: int, run_dir: Path, kills: int) -> dict:
    """Run the command, killing ``kills`` processes along the way. Returns its summary,
    wall time, kills and checks."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    shm_before = set(SHM.iterdir())
    schedule = random.Random(args.schedule)
    started = time.monotonic()
    # Into a file, not a pipe: ten restarts' tracebacks would fill a pipe nobody reads yet.
    log = run_dir.with_suffix(".log")
    with log.open("w") as output:
        launcher = subprocess.Popen(command(args, seed, run_dir), cwd=PROJECT, stdout=output, stderr=output)
    expected = (LEARNERS, REPLAY_PROCESSES, LEARNERS) if uses_replay(args) else (LEARNERS, 0, 0)
    seen: set[int] = set()
    done = []
    killed: set[int] = set()
    while len(done) < kills and launcher.poll() is None:
        found = processes(launcher.pid)
        seen.update(pid for pids in found.values() for pid in pids)
        whole = (len(found["learner"]), len(found["replay"]), len(found["collector"]))
        if whole != expected or killed & set(found["learner"]):
            time.sleep(0.2)  # an attempt still starting, or the last one still going down
            continue
        time.sleep(schedule.uniform(0, args.max_wait))
        kind = schedule.choice(sorted(kind for kind, pids in found.items() if pids))
        victim = schedule.choice(sorted(found[kind]))
        if not alive(victim):
            continue  # the attempt ended meanwhile; draw again for the next one
        rank = rank_of(victim)
        victim_name = (
            f"{kind} (rank {rank})" if kind != "collector" else f"collector of a rank {rank} learner"
        )
        os.kill(victim, signal.SIGKILL)
        killed.update(found["learner"])
        done.append({"at_s": round(time.monotonic() - started, 1), "victim": victim_name})
        print(f"  kill {len(done)} at {done[-1]['at_s']:.0f} s: {victim_name}", flush=True)
    try:
        launcher.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        launcher.kill()
        sys.exit(f"error: the run did not end within {args.timeout} s")
    wall_s = time.monotonic() - started
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    time.sleep(1)  # what a dead attempt left behind has had its moment to go
    left_running = sorted(pid for pid in seen if alive(pid))
    left_in_shm = sorted(str(path) for path in set(SHM.iterdir()) - shm_before)
    lost = [failure["frames_lost"] for failure in summary.get("failures", [])]
    checksums = summary.get("learner_param_checksums", {})
    # total_frames rounded up to whole collector steps of all learners, as train.py plans it
    written = run_dir / "config.yaml"
    planned = config.planned_frames(OmegaConf.load(written), LEARNERS) if written.is_file() else -1
    checks = {
        "exit 0": launcher.returncode == 0,
        "every kill a restart": summary.get("restarts") == len(done),
        "exact frames": summary.get("frames_collected") == planned,
        "at most --every frames lost per restart": all(f is not None and f <= args.every for f in lost),
        "replay holds each frame once": replay_holds_each_frame_once(
            args, written, planned, summary.get("replay_size")
        ),
        "learners identical": len(checksums) == LEARNERS and len(set(checksums.values())) == 1,
        "nothing left running": not left_running,
        "nothing left in /dev/shm": not left_in_shm,
    }
    if launcher.returncode != 0:
        print(f"the run failed: its output is in {log}", file=sys.stderr)
    return {
        "seed": seed,
        "kills": done,
        "wall_s": round(wall_s, 1),
        "eval_return": summary.get("eval_return"),
        "restarts": summary.get("restarts"),
        "failures": summary.get("failures"),
        "frames_collected": summary.get("frames_collected"),
        "left_running": left_running,
        "left_in_shm": left_in_shm,
        "log": str(log),
        "checks": checks,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", default="{{ cookiecutter.default_recipe }}", choices=recipes.available())
    parser.add_argument("--frames", type=int, default=60_000)
    parser.add_argument("--every", type=int, default=4096, help="frames between checkpoints")
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1, help="the training seed of the run under fire")
    parser.add_argument("--quiet-seeds", type=int, nargs="*", default=[1, 2, 3])
    parser.add_argument("--schedule", type=int, default=0, help="seeds the moments and the victims")
    parser.add_argument(
        "--max-wait", type=float, default=20.0, help="most seconds from an attempt's start to its kill"
    )
    parser.add_argument("--timeout", type=float, default=3600.0, help="most seconds a run may take")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for train.py")
    args = parser.parse_args()
    runs_dir = PROJECT / "runs" / "benchmarks"

    quiet = []
    for seed in args.quiet_seeds:
        print(f"undisturbed, seed {seed}", flush=True)
        quiet.append(run(args, seed, runs_dir / f"chaos-quiet-seed{seed}", kills=0))
    print(f"under fire, seed {args.seed}, schedule {args.schedule}", flush=True)
    fire = run(args, args.seed, runs_dir / f"chaos-fire-seed{args.seed}", kills=args.kills)

    print(
        f"{'run':<14} {'seed':>4} {'kills':>5} {'restarts':>8} {'lost frames':>11} {'wall s':>7} {'eval':>7}"
    )
    for name, result in [*(("undisturbed", r) for r in quiet), ("under fire", fire)]:
        lost = sum(f["frames_lost"] or 0 for f in result["failures"] or [])
        print(
            f"{name:<14} {result['seed']:>4} {len(result['kills']):>5} {result['restarts']!s:>8} "
            f"{lost:>11} {result['wall_s']:>7.1f} {result['eval_return'] or float('nan'):>7.1f}"
        )
    returns = [r["eval_return"] for r in quiet if r["eval_return"] is not None]
    if returns:
        fire["checks"]["final evaluation within the undisturbed runs' spread"] = fire[
            "eval_return"
        ] is not None and min(returns) <= fire["eval_return"] <= max(returns)
        overhead = fire["wall_s"] / statistics.mean(r["wall_s"] for r in quiet)
        print(f"wall time under fire / undisturbed: {overhead:.2f}")
    for result in [*quiet, fire]:
        for check, passed in result["checks"].items():
            if not passed:
                print(f"FAILED (seed {result['seed']}, {len(result['kills'])} kills): {check}")
    print(
        json.dumps(
            {"benchmark": "chaos", "recipe": args.recipe, "frames": args.frames, "quiet": quiet, "fire": fire}
        )
    )
    if not all(passed for result in [*quiet, fire] for passed in result["checks"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
