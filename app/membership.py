"""Membership through etcd: workers register themselves, front ends find them.

Each `kvfence worker --discovery etcd://HOST:PORT` keeps one key under `/kvfence/workers/`,
`<role>/<incarnation>`, attached to an etcd lease with a TTL that it keeps alive
(`register_worker`); its value is a `Registration` (role, incarnation, control address, device,
pool, transport endpoint). A new incarnation (the worker's scheduler went away) replaces the key;
SIGTERM revokes the lease last; a worker that dies stops refreshing and its key expires with the
lease. When etcd is unreachable the worker keeps retrying and registers again, under a new lease,
once etcd is back (an etcd restart loses nothing for long).

What etcd says is only where to look. A front end (`find_workers`) connects to the control
address a registration names and trusts nothing of it: the worker must pass the deployment-secret
handshake, and what the front end serves with is the worker's own `Description`, given over the
authenticated connection. A forged registration leads to a peer that gets nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import aetcd
import anyio
import msgspec

log = logging.getLogger(__name__)

PREFIX = b"/kvfence/workers/"
TTL_S = 5  # a dead worker's key outlives it by at most this
ETCD_ERRORS = (aetcd.ClientError, OSError)


class Registration(msgspec.Struct, frozen=True):
    role: str
    incarnation: str
    control: str  # HOST:PORT of its control server
    device: str
    num_pages: int
    transport: str
    endpoint: str  # its KV endpoint's address ("" without one)

    @property
    def key(self) -> bytes:
        return PREFIX + f"{self.role}/{self.incarnation}".encode()


_decoder = msgspec.json.Decoder(Registration)


def etcd_client(host: str, port: int) -> aetcd.Client:
    return aetcd.Client(host=host, port=port, timeout=5, connect_wait_timeout=3)


async def register_worker(host: str, port: int, current: Callable[[], Registration], *,
                          ttl_s: int = TTL_S) -> None:
    """Keep `current()` registered in etcd at host:port until cancelled; the lease is revoked on
    the way out. Called every ttl/3: a changed registration (a new incarnation) replaces the old key."""
    while True:
        try:
            async with etcd_client(host, port) as client:
                lease = await client.lease(ttl_s)
                try:
                    await _keep_registered(client, lease, current, ttl_s)
                finally:
                    with anyio.move_on_after(2, shield=True):
                        try:
                            await lease.revoke()
                        except ETCD_ERRORS:
                            pass
        except ETCD_ERRORS as e:
            log.warning("etcd at %s:%d: %s; registering again in 1 s", host, port, e or type(e).__name__)
            await anyio.sleep(1)


async def _keep_registered(client: aetcd.Client, lease: aetcd.Lease, current: Callable[[], Registration],
                           ttl_s: int) -> None:
    key: bytes | None = None
    while True:
        registration = current()
        if registration.key != key:
            if key is not None:
                await client.delete(key)
            await client.put(registration.key, msgspec.json.encode(registration), lease=lease)
            key = registration.key
            log.info("registered in etcd as %s (lease %x, ttl %d s)", key.decode(), lease.id, ttl_s)
        await anyio.sleep(ttl_s / 3)
        reply = await lease.refresh()
        if reply.TTL <= 0:  # it expired (etcd lost it, or we were away too long): start over
            raise aetcd.ClientError(f"lease {lease.id:x} expired")


async def registered_workers(host: str, port: int) -> list[Registration]:
    """Every worker registered now (undecodable values are skipped, and logged)."""
    async with etcd_client(host, port) as client:
        found = []
        for kv in await client.get_prefix(PREFIX):
            try:
                found.append(_decoder.decode(kv.value))
            except msgspec.DecodeError as e:
                log.warning("etcd key %s is not a worker registration (%s): ignored", kv.key, e)
        return found


async def find_workers(host: str, port: int, wait_s: float) -> list[Registration]:
    """The registered workers once there is at least one prefill and one decode worker, waiting up
    to `wait_s` for them (and for etcd). TimeoutError naming what was found."""
    found: list[Registration] = []
    with anyio.move_on_after(wait_s):
        while True:
            try:
                found = await registered_workers(host, port)
            except ETCD_ERRORS as e:
                log.warning("etcd at %s:%d: %s; retrying", host, port, e or type(e).__name__)
            if {r.role for r in found} >= {"prefill", "decode"}:
                return found
            await anyio.sleep(0.5)
    roles = ", ".join(f"{r.role} at {r.control}" for r in found) or "none"
    raise TimeoutError(f"etcd at {host}:{port} lists no prefill and decode worker after {wait_s:g} s (found: {roles})")
