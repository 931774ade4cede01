"""Membership through etcd: workers register themselves, front ends find them.

Each `kvfence worker --discovery etcd://HOST:PORT` keeps one key under `/kvfence/workers/`,
`<role>/<incarnation>`, attached to an etcd lease with a TTL that it keeps alive
(`register_worker`); its value is a `Registration` (role, incarnation, control address, device,
pool, transport endpoint) signed with the deployment secret (`Signed`: a MAC with a key of its own
over the etcd key and the registration). A new incarnation (the worker's scheduler went away)
replaces the key; a key that disappears (or changes) while the worker lives is put back within a
third of the TTL; SIGTERM revokes the lease last; a worker that dies stops refreshing and its key
expires with the lease. When etcd is unreachable the worker keeps retrying and registers again,
under a new lease, once etcd is back (an etcd restart loses nothing for long).

Front ends list the prefix and watch it (`watch_workers`), listing again after every change and
every few seconds regardless, so a watch lost to an etcd restart costs seconds, not membership.

What etcd says is only where to look, and only what a member signed: a front end ignores (and logs
once) a value that is not a registration signed with its deployment secret for that very key, so
it never dials an address that someone with write access to etcd made up. It then connects to the
control address a verified registration names and trusts nothing else of it: the worker must pass the deployment-secret
handshake, and what the front end serves with is the worker's own `Description`, given over the
authenticated connection, sealed after its handshake. A forged registration leads to a peer that
gets nothing, or to a relay of the real worker that can read and change nothing (it can only cut
the connection).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Awaitable, Callable

import aetcd
import anyio
import msgspec

from kvfence.transports.core.secret import DeploymentSecret

log = logging.getLogger(__name__)

PREFIX = b"/kvfence/workers/"
TTL_S = 5  # a dead worker's key outlives it by at most this
RELIST_S = 5.0  # a front end lists the workers at least this often, watch or not
MAX_REFUSED_REMEMBERED = 4096  # refused values a front end remembers, so each is logged once
ETCD_ERRORS = (aetcd.ClientError, OSError)


class Signed(msgspec.Struct, frozen=True):
    """The value under a worker's key: its `Registration` as JSON text, and the MAC over the key
    and that text (DeploymentSecret.registration_mac)."""

    registration: str
    mac: str


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
_signed_decoder = msgspec.json.Decoder(Signed)


def signed_value(registration: Registration, secret: DeploymentSecret) -> bytes:
    """What a worker puts under `registration.key`."""
    body = msgspec.json.encode(registration)
    return msgspec.json.encode(Signed(body.decode(), secret.registration_mac(registration.key, body)))


def verified(key: bytes, value: bytes, secret: DeploymentSecret | None) -> Registration:
    """The registration `value` under `key` holds; ValueError saying why it is not one of this
    deployment's (undecodable, not signed with `secret`, or naming another key). `secret` None:
    read it unverified (for display only, `kvfence status` without the secret)."""
    try:
        signed = _signed_decoder.decode(value)
        body = signed.registration.encode()
        registration = _decoder.decode(body)
    except msgspec.DecodeError as e:
        raise ValueError(f"not a signed worker registration ({e})") from None
    if secret is not None and not secret.registration_ok(signed.mac, key, body):
        raise ValueError("its signature does not verify (written without this deployment's secret)")
    if registration.key != key:
        raise ValueError(f"it is signed for {registration.key.decode()!r}, not for this key")
    return registration


def etcd_client(host: str, port: int) -> aetcd.Client:
    return aetcd.Client(host=host, port=port, timeout=5, connect_wait_timeout=3)


async def register_worker(host: str, port: int, current: Callable[[], Registration], secret: DeploymentSecret, *,
                          ttl_s: int = TTL_S) -> None:
    """Keep `current()` registered in etcd at host:port, signed with `secret`, until cancelled;
    the lease is revoked on the way out. Called every ttl/3: a changed registration (a new
    incarnation) replaces the old key, and a key deleted or overwritten meanwhile is put back."""
    while True:
        try:
            async with etcd_client(host, port) as client:
                lease = await client.lease(ttl_s)
                try:
                    await _keep_registered(client, lease, current, secret, ttl_s)
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
                           secret: DeploymentSecret, ttl_s: int) -> None:
    key: bytes | None = None
    value = b""
    while True:
        registration = current()
        if registration.key != key:
            if key is not None:
                await client.delete(key)
            value = signed_value(registration, secret)
            await client.put(registration.key, value, lease=lease)
            key = registration.key
            log.info("registered in etcd as %s (lease %x, ttl %d s)", key.decode(), lease.id, ttl_s)
        else:
            found = await client.get(key)
            if found is None or found.value != value:
                log.warning("etcd key %s was %s while this worker lives: putting it back", key.decode(),
                            "deleted" if found is None else "overwritten")
                await client.put(key, value, lease=lease)
        await anyio.sleep(ttl_s / 3)
        reply = await lease.refresh()
        if reply.TTL <= 0:  # it expired (etcd lost it, or we were away too long): start over
            raise aetcd.ClientError(f"lease {lease.id:x} expired")


async def registered_workers(host: str, port: int, secret: DeploymentSecret | None) -> list[Registration]:
    """Every worker registered now with a registration signed with `secret` (others are skipped,
    and logged; None: every registration, unverified, for display only)."""
    async with etcd_client(host, port) as client:
        return await _listed(client, secret, set())


async def _listed(client: aetcd.Client, secret: DeploymentSecret | None, refused: set[bytes]) -> list[Registration]:
    """The verified registrations; each value refused is logged once (`refused` remembers them)."""
    found = []
    for kv in await client.get_prefix(PREFIX):
        try:
            found.append(verified(kv.key, kv.value, secret))
        except ValueError as e:
            mark = hashlib.sha256(kv.key + b"\0" + kv.value).digest()
            if len(refused) >= MAX_REFUSED_REMEMBERED:  # an etcd writer minting values: log them again
                refused.clear()
            if mark not in refused:
                refused.add(mark)
                log.warning("etcd key %s is ignored, never dialled: %s", kv.key.decode(errors="replace"), e)
    return found


async def watch_workers(host: str, port: int, secret: DeploymentSecret,
                        on_change: Callable[[list[Registration]], None], *, relist_s: float = RELIST_S) -> None:
    """Until cancelled, call `on_change` with every worker registered: at once, after every change
    etcd's watch of the prefix reports, and every `relist_s` in any case (a watch that a restart
    of etcd broke silently costs at most that). While etcd is unreachable it retries every second;
    `on_change` is not called then (what was listed last stands). Only registrations signed with
    `secret` are listed."""
    refused: set[bytes] = set()
    while True:
        try:
            async with etcd_client(host, port) as client:
                watch = await client.watch_prefix(PREFIX)
                try:
                    while True:
                        on_change(await _listed(client, secret, refused))
                        with anyio.move_on_after(relist_s):
                            await anext(aiter(watch))  # the next change (or none: list again anyway)
                finally:
                    await _on_the_way_out(watch.cancel)
        except (*ETCD_ERRORS, StopAsyncIteration) as e:
            log.warning("watching etcd at %s:%d: %s; again in 1 s", host, port, e or type(e).__name__)
            await anyio.sleep(1)


async def find_workers(host: str, port: int, secret: DeploymentSecret, wait_s: float) -> list[Registration]:
    """The workers registered with a signature of `secret` once there is at least one prefill and
    one decode worker, waiting up to `wait_s` for them (and for etcd). TimeoutError naming what
    was found."""
    found: list[Registration] = []
    refused: set[bytes] = set()
    with anyio.move_on_after(wait_s):
        while True:
            try:
                async with etcd_client(host, port) as client:
                    found = await _listed(client, secret, refused)
            except ETCD_ERRORS as e:
                log.warning("etcd at %s:%d: %s; retrying", host, port, e or type(e).__name__)
            if {r.role for r in found} >= {"prefill", "decode"}:
                return found
            await anyio.sleep(0.5)
    roles = ", ".join(f"{r.role} at {r.control}" for r in found) or "none"
    raise TimeoutError(f"etcd at {host}:{port} lists no prefill and decode worker after {wait_s:g} s (found: {roles})")
