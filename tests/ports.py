"""Ports for the servers tests start."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range where the machine has room for one:
    the server binds it after starting its transports, whose listeners (and UCX's, and every
    client socket) take ports of that range, one of which could otherwise be this one by then."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    for _ in range(64 if low > 12_000 else 0):
        port = random.randrange(10_000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
