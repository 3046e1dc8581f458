"""Every rank watches every other, so no rank waits forever for one that died.

Each rank (learners and replay processes alike) bumps a heartbeat counter in a key-value
store every second, and a background thread reads everybody's. When a rank's counter stops
moving for ``timeout`` seconds (it was killed, ran out of memory, or hangs), or a rank
reports that it failed, every other rank logs one line naming that rank and its role and
exits with code 1, whatever it was waiting for: an RPC, a collective, the final barrier.
A rank's first beat may take ``startup_s`` (replay processes start after rank 0), and a
rank that closed its watchdog at the end of the run has finished, not died. The store is
torch's ``TCPStore``, hosted by rank 0 on its own port; when rank 0 dies its store goes
with it, and the others name rank 0. Rank 0 also polls its replay processes, its children.

Why not leave it to the launcher: ``fabric run`` (torchrun) stops all ranks when one exits,
but Fabric's own launcher and ``srun`` do not, and no launcher tells the ranks which rank
failed. Counters rather than timestamps: the nodes' clocks need not agree.

The same store carries a stop request (SIGINT, SIGTERM, SIGUSR1) from whichever rank received it to
all the others.

Under ``fabric run`` and torchrun each rank also watches its launcher. They start every rank
in a session of its own, so when the launcher itself is killed (the OOM killer, a
scheduler's hard kill) nothing reaches the ranks, and they would train on alone and hold
their ports. The rank's parent changes when the launcher dies (``PR_SET_PDEATHSIG`` would not
do: it is not inherited across the exec that starts the rank), so the thread compares the
parent's pid with the one it started under, and every rank exits within a second or two.
A replay process watches rank 0, its parent, the same way.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing import resource_tracker

import torch.distributed as dist

from .topology import Topology, store

log = logging.getLogger(__name__)

INTERVAL_S = 1.0
FAILED = "failed"  # the first failure's message; later ones do not overwrite it
STOP = "stop"  # the name of the first stop signal any rank received
CLOSED = "closed/{rank}"  # set by a rank other than 0 once it has closed its watchdog
# SIGUSR1: what slurm.sh asks SLURM to send before the time limit (#SBATCH --signal).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
# What a store call raises once the store is gone.
STORE_ERRORS = (RuntimeError, dist.DistError)


class RankFailure(Exception):
    """A failure this rank explains in one line (a dead child process, say): reported
    without a traceback."""


class StopRequest(threading.Event):
    """Set when this rank, or any other, received SIGINT, SIGTERM or SIGUSR1; ``signal``
    names it."""

    signal: str | None = None

    def request(self, signal_name: str) -> None:
        if not self.is_set():
            self.signal = signal_name
            self.set()


class Watchdog:
    def __init__(
        self,
        topology: Topology,
        address: str,
        port: int,
        timeout_s: float,
        startup_s: float,
        parent: str | None = None,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        """``startup_s``: how long a rank may take to send its first heartbeat (a replay
        process starts after rank 0 has); ``parent`` names this process's parent when the
        process must not outlive it; ``on_failure(reason)`` records why this process gives
        up (restarts.failed), before it goes."""
        self.topology = topology
        self.timeout_s = timeout_s
        self.startup_s = startup_s
        self.children: dict[int, subprocess.Popen] = {}
        self.deaths: dict[str, Callable[[], str | None]] = {}  # watch(): why each child died, or None
        self.stop = StopRequest()
        self._closing = threading.Event()
        self._giving_up = threading.Lock()  # one reason per process, from whichever thread is first
        self.store = None
        if topology.world_size > 1:
            self.store = store(address, port, topology.rank, topology.world_size, timeout_s)
        self.parent = (parent, os.getppid()) if parent else None
        self.on_failure = on_failure
        self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)

    @contextmanager
    def watching(self) -> Iterator[Watchdog]:
        """Watch the other ranks and catch stop signals while the block runs. An exception
        in the block is logged, told to the other ranks, and ends this process with code 1."""
        # multiprocessing's resource tracker (one process, started on first use) ignores
        # SIGINT and SIGTERM but dies of SLURM's SIGUSR1, which reaches every process of a
        # job, and with it goes its record of the shared memory to clean up: start it now,
        # ignoring them all.
        with signals_ignored(*STOP_SIGNALS):
            resource_tracker.ensure_running()
        previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        if self.store is not None:
            # The first beat now, not a second from now: every rank beats before it can reach
            # the RPC world's rendezvous, so a rank that dies once training has begun is
            # "stopped" after timeout_s, never "did not start" (the start-up's allowance).
            self.store.add(f"beat/{self.topology.rank}", 1)
        if self.store is not None or self.parent is not None:
            self._thread.start()
        try:
            yield self
        except (FloatingPointError, RankFailure) as error:
            # The training itself went wrong (learner.NonFinite), or a child process of
            # this rank did: one line says where.
            self._give_up(f"{self.label(self.topology.rank)} failed: {error}")
        except BaseException as error:
            if self.store is None:
                raise
            if isinstance(error, RuntimeError):
                # How another rank's death shows up here: a collective or an RPC failed
                # (gloo, TensorPipe and DDP raise RuntimeError). Give the heartbeats time
                # to name the rank that died before blaming this one.
                time.sleep(self.timeout_s + 2 * INTERVAL_S)
            log.exception("this rank failed")
            self._give_up(f"{self.label(self.topology.rank)} failed: {type(error).__name__}: {error}")
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        self._close()

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if not self.stop.is_set():
            log.warning("%s: stopping cleanly at the next step (SIGKILL stops at once)", name)
            self.stop.request(name)
            self._tell_others(STOP, name)

    def take_up_stop(self) -> None:
        """Stop as another rank asked: the watch takes the request up within a second of its
        reaching the store, and a learner takes it up as soon as the learners agree to stop,
        to write its part of the checkpoint the others write. The rank that received the
        signal wrote its name to the store before it could agree."""
        if not self.stop.is_set():
            self.stop.request(self.store.get(STOP).decode())

    def _tell_others(self, key: str, value: str) -> None:
        if self.store is None:
            return
        try:
            self.store.compare_set(key, "", value)
        except STORE_ERRORS:
            pass  # the store is gone: the others notice this rank's silence instead

    def _watch(self) -> None:
        me = self.topology.rank
        others = [rank for rank in range(self.topology.world_size) if rank != me]
        last_seen = {rank: (-1, time.monotonic()) for rank in others}
        while not self._closing.wait(INTERVAL_S):
            if self.parent is not None and os.getppid() != self.parent[1]:
                name, pid = self.parent
                self._give_up(f"{name} is gone (pid {pid}): this process does not outlive it")
            for what, death in list(self.deaths.items()):  # watch() may add one meanwhile
                reason = death()
                if reason is not None and what in self.deaths:  # not unwatched while asked
                    self._give_up(reason)
            if self.store is None:
                continue
            try:
                self.store.add(f"beat/{me}", 1)
                if self.store.check([FAILED]):
                    self._give_up(self.store.get(FAILED).decode())
                if self.store.check([STOP]):
                    self.take_up_stop()
                for rank, process in list(self.children.items()):  # adopt() may add one meanwhile
                    # A child that closed its watchdog has done its part: how its exit went
                    # is for replay_processes.join to tell, not a death that stops the run.
                    if process.poll() and not self._closed(rank):
                        self._give_up(f"{self.label(rank)} died: {exit_status(process.returncode)}")
                now = time.monotonic()
                for rank in others:
                    count = self.store.add(f"beat/{rank}", 0)
                    previous, since = last_seen[rank]
                    if count != previous:
                        last_seen[rank] = (count, now)
                        continue
                    limit = self.startup_s if count == 0 else self.timeout_s
                    # A rank that closed its watchdog has finished (it stops beating then), not died.
                    if now - since > limit and not self._closed(rank):
                        what = "did not start" if count == 0 else "stopped"
                        self._give_up(f"{self.label(rank)} {what}: no heartbeat for {limit:g} s")
            except STORE_ERRORS:
                if self._closing.is_set():
                    return
                self._give_up(f"{self.label(0)} stopped: its store does not answer")

    def _close(self) -> None:
        """Stop watching once every rank is through the final barrier. Rank 0 hosts the
        store, so it leaves last: it waits until the others have stopped using it."""
        self._closing.set()
        if self._thread.is_alive():
            self._thread.join()
        if self.store is None:
            return
        me = self.topology.rank
        try:
            if me == 0:
                others = [CLOSED.format(rank=rank) for rank in range(1, self.topology.world_size)]
                self.store.wait(others, timedelta(seconds=self.timeout_s))
            else:
                self.store.set(CLOSED.format(rank=me), "1")
        except STORE_ERRORS as error:
            log.warning("closing the watchdog's store: %s", str(error).splitlines()[0])

    def _closed(self, rank: int) -> bool:
        """Whether ``rank`` closed its watchdog: it has done its part of the run."""
        return self.store.check([CLOSED.format(rank=rank)])

    def adopt(self, rank: int, process: subprocess.Popen) -> None:
        """Watch ``process``, this process's child hosting ``rank``: the run stops if it dies,
        and it is killed if the run stops on a failure."""
        self.children[rank] = process

    def watch(self, what: str, death: Callable[[], str | None]) -> None:
        """Stop the run within a second once ``death()`` gives the reason ``what`` died: a
        child process no heartbeat covers (an async collector), which a wait on it would
        otherwise notice only at its deadline."""
        self.deaths[what] = death

    def unwatch(self, what: str) -> None:
        """``what`` is about to end on purpose."""
        self.deaths.pop(what, None)

    def label(self, rank: int) -> str:
        return f"rank {rank} ({self.topology.roles[str(rank)]})"

    @contextmanager
    def deadline(self, what: str, timeout_s: float) -> Iterator[None]:
        """Stop the run, naming ``what``, if the block takes longer than ``timeout_s``
        seconds: for waits on a child process, which no heartbeat covers."""
        timer = threading.Timer(timeout_s, self._give_up, [f"{what} stopped: nothing for {timeout_s:g} s"])
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()

    def _give_up(self, reason: str) -> None:
        """Exit with code 1 after passing the reason on: the others may not have noticed
        yet, and once rank 0 leaves, its store cannot tell them."""
        if not self._giving_up.acquire(blocking=False):
            # The other thread (watchdog or main) is giving up already and ends this process:
            # a second reason would only blur the first.
            threading.Event().wait()
        log.error("stopping: %s", reason)
        if self.on_failure is not None:
            try:
                self.on_failure(reason)
            except OSError as error:  # a record that cannot be written must not stop the exit
                log.warning("could not record the failure: %s", error)
        if self.store is None and threading.current_thread() is threading.main_thread():
            raise SystemExit(1)  # one process: nothing else to stop, nothing blocks the exit
        self._tell_others(FAILED, reason)
        if self.topology.rank == 0:
            time.sleep(2 * INTERVAL_S)
        exit_now(1, list(self.children.values()))


def exit_status(code: int) -> str:
    """A child's return code in words."""
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def exit_now(code: int, children: list[subprocess.Popen]) -> None:
    """Leave at once: whatever the main thread waits in (an RPC, a gloo collective, the RPC
    shutdown barrier) cannot be woken safely, and interpreter shutdown would wait for it.
    Child processes (an async collector, replay processes) are killed first: one that hangs
    would never notice that this process is gone."""
    for child in multiprocessing.active_children():
        child.kill()
    for process in children:
        process.kill()
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@contextmanager
def signals_ignored(*signals: signal.Signals) -> Iterator[None]:
    """Ignore ``signals`` in the block: a process started in it ignores them too (an ignored
    signal stays ignored across fork and exec, and Python keeps it so)."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
