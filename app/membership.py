"""Membership through etcd: workers register themselves, front ends find them.

Each `kvfence worker --discovery etcd://HOST:PORT` keeps one key under `/kvfence/workers/`,
`<role>/<incarnation>`, attached to an etcd lease with a TTL that it keeps alive
(`register_worker`); its value is a `Registration` (role, incarnation, control address, device,
pool, transport endpoint). A new incarnation (the worker's scheduler went away) replaces the key;
SIGTERM revokes the lease last; a worker that dies stops refreshing and its key expires with the
lease. When etcd is unreachable the worker keeps retrying and registers again, under a new lease,
once etcd is back (an etcd restart loses nothing for long).

Front ends list the prefix and watch it (`watch_workers`), listing again after every change and
every few seconds regardless, so a watch lost to an etcd restart costs seconds, not membership.

What etcd says is only where to look. A front end (`find_workers`) connects to the control
address a registration names and trusts nothing of it: the worker must pass the deployment-secret
handshake, and what the front end serves with is the worker's own `Description`, given over the
authenticated connection. A forged registration leads to a peer that gets nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import aetcd
import anyio
import msgspec

log = logging.getLogger(__name__)

PREFIX = b"/kvfence/workers/"
TTL_S = 5  # a dead worker's key outlives it by at most this
RELIST_S = 5.0  # a front end lists the workers at least this often, watch or not
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
                    await _on_the_way_out(lease.revoke)
        except ETCD_ERRORS as e:
            log.warning("etcd at %s:%d: %s; registering again in 1 s", host, port, e or type(e).__name__)
            await anyio.sleep(1)


async def _on_the_way_out(undo: Callable[[], Awaitable[object]]) -> None:
    """Await `undo()` for up to 2 s, even when cancelled; an etcd error is ignored (etcd forgets
    a lease or a watch by itself when the client is gone)."""
    with anyio.move_on_after(2, shield=True):
        try:
            await undo()
        except ETCD_ERRORS:
            pass


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
        return await _listed(client)


async def _listed(client: aetcd.Client) -> list[Registration]:
    found = []
    for kv in await client.get_prefix(PREFIX):
        try:
            found.append(_decoder.decode(kv.value))
        except msgspec.DecodeError as e:
            log.warning("etcd key %s is not a worker registration (%s): ignored", kv.key, e)
    return found


async def watch_workers(host: str, port: int, on_change: Callable[[list[Registration]], None], *,
                        relist_s: float = RELIST_S) -> None:
    """Until cancelled, call `on_change` with every worker registered: at once, after every change
    etcd's watch of the prefix reports, and every `relist_s` in any case (a watch that a restart
    of etcd broke silently costs at most that). While etcd is unreachable it retries every second;
    `on_change` is not called then (what was listed last stands)."""
    while True:
        try:
            async with etcd_client(host, port) as client:
                watch = await client.watch_prefix(PREFIX)
                try:
                    while True:
                        on_change(await _listed(client))
                        with anyio.move_on_after(relist_s):
                            await anext(aiter(watch))  # the next change (or none: list again anyway)
                finally:
                    await _on_the_way_out(watch.cancel)
        except (*ETCD_ERRORS, StopAsyncIteration) as e:
            log.warning("watching etcd at %s:%d: %s; again in 1 s", host, port, e or type(e).__name__)
            await anyio.sleep(1)


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
