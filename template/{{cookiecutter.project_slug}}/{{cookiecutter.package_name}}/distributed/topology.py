"""Who does what: learner ranks, replay processes, the learners' process group, the RPC world.

Every rank Fabric launches is a learner (ranks 0 .. N-1), so on an N-GPU node all N GPUs
train. A replay recipe on several learners adds ``replay.processes`` CPU processes that rank
0 starts beside them (replay_processes.py), each hosting one replay shard; they join the RPC
world and the watchdog's store as ranks N .. N+R-1, and never Fabric's process group.
Rank 0 also keeps the run's records (metrics, summary.json). Objects a process serves over
RPC are registered with ``host`` and reached from any rank through ``handle``.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple
from urllib.parse import parse_qsl, urlparse

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from lightning_fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

REPLAY = "replay"
LEARNER = "learner"


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int  # the RPC world: learners and replay processes
    replay_ranks: tuple[int, ...]
    learner_ranks: tuple[int, ...]

    @classmethod
    def plan(cls, learners: int, rank: int, replay_ranks: int, uses_replay: bool) -> Topology:
        """Assign roles to ``learners`` learner ranks and, for a replay recipe, the replay
        processes after them. One learner keeps its buffer in-process: no RPC at all."""
        if learners == 1:
            return cls(rank, 1, (), (0,))
        replay = replay_ranks if uses_replay else 0
        return cls(rank, learners + replay, tuple(range(learners, learners + replay)), tuple(range(learners)))

    @property
    def role(self) -> str:
        return REPLAY if self.rank in self.replay_ranks else LEARNER

    @property
    def roles(self) -> dict[str, str]:
        return {str(r): (REPLAY if r in self.replay_ranks else LEARNER) for r in range(self.world_size)}

    @property
    def learner_index(self) -> int:
        return self.learner_ranks.index(self.rank)

    def layout(self, uses_replay: bool) -> tuple[int, int]:
        """The number of learners and of replay shards, as checkpoints record them."""
        return len(self.learner_ranks), len(self.shard_ranks) if uses_replay else 0

    @property
    def shard_ranks(self) -> tuple[int, ...]:
        """Ranks holding a replay shard; rank 0 itself when there is one process."""
        return self.replay_ranks or (0,)


def bind_to_loopback_unless_named(address: str | None) -> None:
    """Keep gloo and TensorPipe on the loopback interface unless an address was named.

    RPC runs pickled calls: whoever reaches its port can run code on this machine.
    """
    address = main_address(address)
    try:
        loopback = ipaddress.ip_address(socket.gethostbyname(address)).is_loopback
    except (OSError, ValueError):
        loopback = False
    if loopback:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("TP_SOCKET_IFNAME", "lo")


def cpus_per_rank(ranks_here: int) -> int:
    """The cores one rank of this node may use. Under SLURM a task has
    ``SLURM_CPUS_PER_TASK`` cores: a rank's own when srun starts one task per rank, its
    node's ranks' to share when the task is a torchrun agent (slurm.sh). Otherwise the ranks
    share what this process may run on (its CPU affinity: what the scheduler, a cgroup or
    taskset allows), which can be far fewer than the machine's cores that
    ``os.cpu_count()`` counts."""
    if "SLURM_CPUS_PER_TASK" in os.environ and SLURMEnvironment.detect():
        ranks_per_task = ranks_here if TorchElasticEnvironment.detect() else 1
        return max(1, int(os.environ["SLURM_CPUS_PER_TASK"]) // ranks_per_task)
    return max(1, len(os.sched_getaffinity(0)) // ranks_here)


def join_restarted_attempt(timeout_s: float) -> None:
    """Under torchelastic's agent store, join the default process group under a prefix of
    this attempt, before Fabric would join it.

    torchrun's agent serves one store for every restart of its workers
    (``TORCHELASTIC_USE_AGENT_STORE``), and torch 2.14 gives the process group's keys no
    prefix per attempt: the workers of a restart read the addresses the dead attempt's left
    there, and Gloo's full mesh fails ("connection refused"). Fabric finds the group made
    and goes on with it."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True) or dist.is_initialized():
        return
    agent_store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        # Gloo for CPU tensors, NCCL for a GPU's: the backend Fabric would pick for either.
        "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo",
        store=dist.PrefixStore(f"attempt-{attempt}", agent_store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timedelta(seconds=timeout_s),
    )


def main_address(address: str | None) -> str:
    """The address rank 0 serves on: the one named, or the launcher's main address."""
    return address or os.environ.get("MASTER_ADDR", "127.0.0.1")


class Endpoints(NamedTuple):
    """Where rank 0 serves RPC's rendezvous and the watchdog's store."""

    address: str
    rpc_port: int
    watchdog_port: int


def endpoints(
    address: str | None, port: int | None, plan: Topology, broadcast: Callable[[Any, int], Any]
) -> Endpoints:
    """The named address, or the launcher's main address; a named ``port`` and the one
    after it, or two ports the kernel picks as free on rank 0, which keeps them bound for
    the stores and hands them to the other learners with ``broadcast`` (Fabric's).

    Not ports counted from the launcher's main port: under torchrun that is its agent's
    store, on a port the kernel picked from the range it also gives outgoing connections,
    so the ports after it may be held by any connection on the node, or by a dead attempt's
    in TIME_WAIT when torchrun starts the learners again ("Address already in use").
    """
    address = main_address(address)
    if port:
        return Endpoints(address, port, port + 1)
    if plan.world_size == 1:
        return Endpoints(address, 0, 0)  # one process serves no store
    reserved = (_reserve(address), _reserve(address)) if plan.rank == 0 else None
    return Endpoints(address, *broadcast(reserved, 0))


# Rank 0's listening sockets on ports the kernel picked, until ``store`` takes them.
_RESERVED: dict[int, socket.socket] = {}


def _listening(address: str, port: int) -> socket.socket:
    family, kind, _, _, where = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(where)
    sock.listen(socket.SOMAXCONN)
    return sock


def _reserve(address: str) -> int:
    sock = _listening(address, 0)
    port = sock.getsockname()[1]
    _RESERVED[port] = sock
    return port


def store(address: str, port: int, rank: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """A key-value store served by rank 0 on ``address`` only.

    A ``TCPStore`` left to itself listens on every interface; given a socket already bound
    to one address (``master_listen_fd``), it listens there. Rank 0 does not wait for the
    others to connect.
    """
    listen_fd = None
    if rank == 0:
        sock = _RESERVED.pop(port, None) or _listening(address, port)
        listen_fd = sock.detach()  # the store owns and closes it
    return dist.TCPStore(
        address,
        port,
        world_size,
        is_master=rank == 0,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=listen_fd,
    )


BOUND_TCP = "bound-tcp"


def _bound_tcp_rendezvous(url: str, **kwargs: Any):
    """``init_rpc``'s rendezvous through ``store``: torch's own ``tcp://`` handler creates a
    store that listens on every interface, and a handler is the public way to give RPC
    another (``register_rendezvous_handler``)."""
    parsed = urlparse(url)
    query = dict(parse_qsl(parsed.query))
    rank, world_size = int(query["rank"]), int(query["world_size"])
    yield store(parsed.hostname, parsed.port, rank, world_size, float(query["timeout"])), rank, world_size
    raise RuntimeError("the RPC world cannot be re-formed")


dist.register_rendezvous_handler(BOUND_TCP, _bound_tcp_rendezvous)


def connect(topology: Topology, address: str, port: int, timeout_s: float, collective_timeout_s: float):
    """Create the learner group and join the RPC world; returns the learner group.

    The learner group spans Fabric's ranks, with its own timeout for collectives (a large
    checkpoint can take longer to write than an RPC may take); replay processes are not in
    Fabric's process group and join the RPC world only. RPC gets its own port so it never
    collides with Fabric's c10d store. ``timeout_s`` bounds an RPC.
    """
    if topology.world_size == 1:
        return None
    learner_group = None
    if topology.role == LEARNER:
        timeout = timedelta(seconds=collective_timeout_s)
        learner_group = dist.new_group(list(topology.learner_ranks), timeout=timeout)
    host = f"[{address}]" if ":" in address else address  # an IPv6 address in a URL
    with warnings.catch_warnings():
        # init_rpc's own device-map exchange trips a torch deprecation warning; not ours to fix.
        warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
        rpc.init_rpc(
            f"rank{topology.rank}",
            rank=topology.rank,
            world_size=topology.world_size,
            # Only TensorPipe's TCP transport: its shared-memory transport busy-polls one core
            # per rank, which made training four times slower with 3 ranks on 2 cores.
            rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
                init_method=f"{BOUND_TCP}://{host}:{port}?timeout={timeout_s}",
                rpc_timeout=timeout_s,
                _transports=["uv"],
            ),
        )
    return learner_group


def disconnect(topology: Topology) -> None:
    """Leave the RPC world. Graceful shutdown waits until every rank got here."""
    if topology.world_size > 1:
        rpc.shutdown()


_HOSTED: dict[str, Any] = {}


def host(name: str, obj: Any) -> None:
    """Serve ``obj`` under ``name`` on this rank. Call before ``connect``."""
    _HOSTED[name] = obj


def hosted(name: str) -> Any:
    return _HOSTED[name]


def handle(topology: Topology, owner: int, name: str) -> Any:
    """An RRef to the object ``name`` hosted on rank ``owner``.

    Call its methods with ``.rpc_async().method(...)`` (a future) or ``.rpc_sync()``.
    """
    if topology.world_size == 1:
        return LocalRef(_HOSTED[name])
    return rpc.remote(owner, hosted, args=(name,))


class LocalRef:
    """The RRef interface for an object in this process, so one-process runs share the code."""

    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def rpc_sync(self) -> Any:
        return self._obj

    def rpc_async(self) -> _CompletedCalls:
        return _CompletedCalls(self._obj)


class _CompletedCalls:
    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def __getattr__(self, name: str):
        method = getattr(self._obj, name)

        def call(*args: Any, **kwargs: Any) -> torch.futures.Future:
            future: torch.futures.Future = torch.futures.Future()
            future.set_result(method(*args, **kwargs))
            return future

        return call
