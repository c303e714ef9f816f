"""Test-only: loopback ports — free ones to bind, and the ones a process listens on."""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def free_port_block(count: int) -> int:
    """First port of ``count`` consecutive free loopback ports, below the ephemeral range.

    A stack numbers its metrics ports upwards from one base; a base taken from ``bind(0)``
    lies in the kernel's ephemeral range (32768-60999 here), where the children's own Kafka
    connections can take the next ports before a worker binds them. 20000-32000 is outside it.
    """
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 32000 - count)
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports in 20000-32000 on 127.0.0.1")


def listening_sockets(pid: int) -> set[tuple[str, int]]:
    """(address as /proc writes it — little-endian hex —, port) of the LISTEN sockets owned
    by ``pid``, from /proc/net/tcp and tcp6."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A = LISTEN
                addr, port = cols[1].split(":")
                found.add((addr, int(port, 16)))
    return found
