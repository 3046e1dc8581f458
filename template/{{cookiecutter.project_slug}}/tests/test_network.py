"""What a real run exposes to the network: every socket its ranks listen on is on loopback."""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from pathlib import Path

from .conftest import RECIPES, REPLAY_RECIPE, fabric_command, free_port, launch, processes_of, tiny_overrides

RECIPE = REPLAY_RECIPE or RECIPES[0]
LISTEN = "0A"  # the TCP state of a listening socket in /proc/net/tcp


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process ``pid`` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != LISTEN or fields[9] not in inodes:
                continue
            address, port = fields[1].split(":")
            # The kernel prints the address as 32-bit words in host (little-endian) order.
            raw = b"".join(bytes.fromhex(address[i : i + 8])[::-1] for i in range(0, len(address), 8))
            found.add((socket.inet_ntop(family, raw), int(port, 16)))
    return found


def test_every_listening_socket_of_a_three_rank_run_is_on_loopback(tmp_path):
    run_dir = tmp_path / "run"
    rpc_port = free_port()
    overrides = [*tiny_overrides(RECIPE), f"run_dir={run_dir}"]
    process = launch(fabric_command(3, "train.py", f"rpc.port={rpc_port}", *overrides))
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the run did not open its RPC and watchdog ports"
            ranks = {pid: rank for pid, rank in processes_of(run_dir).items() if rank is not None}
            sockets = {}
            for pid, rank in ranks.items():
                try:
                    sockets[rank] = listening(pid)
                except OSError:  # the rank is starting or leaving
                    pass
            ports = {port for found in sockets.values() for _, port in found}
            # Connected: rank 0 serves RPC's rendezvous and the watchdog's store, and every
            # rank has its gloo and TensorPipe listeners up.
            if len(sockets) == 3 and {rpc_port, rpc_port + 1} <= ports and all(sockets.values()):
                break
            time.sleep(0.2)
    finally:
        _, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr[-3000:]
    for rank, found in sockets.items():
        exposed = [f"{host}:{port}" for host, port in found if not ipaddress.ip_address(host).is_loopback]
        assert not exposed, f"rank {rank} listens beyond loopback: {exposed}"
