"""Connections that never speak, for the tests of the budgets of listening sockets
(transports/wire/pending.py): a flood of `FLOOD` of them, and the descriptors it needs."""

from __future__ import annotations

import resource
import socket

import pytest

from kvfence.transports.wire.channel import split_address

FLOOD = 1000


def connect(address: str) -> socket.socket:
    """A blocking TCP connection to "host:port" (5 s timeout on every operation)."""
    return socket.create_connection(split_address(address), timeout=5)


def enough_descriptors(n: int) -> None:
    """Raise this process's soft limit on open files to hold `n` more sockets (skip if it cannot)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = n + 512
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"{n} connections need {want} file descriptors; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
