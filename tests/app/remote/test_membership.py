"""Worker membership in a real etcd (app/remote/membership.py): a worker's key lives under a lease it
keeps alive, a new incarnation replaces it, SIGTERM's revoke removes it at once, a key deleted or
overwritten while the worker lives is put back, and after etcd restarts the registration comes
back by itself. Only registrations signed with the deployment secret for their own key are ever
listed, so a front end never dials what an etcd writer made up. A front end waiting for workers
says what it found when they do not come."""

from __future__ import annotations

from pathlib import Path

import anyio
import msgspec
import pytest
from etcd_server import EtcdServer

from kvfence.app.remote.membership import (ETCD_ERRORS, PREFIX, Registration, etcd_client, find_workers,
                                           register_worker, registered_workers, signed_value)
from kvfence.transports.core.secret import DeploymentSecret

SECRET = DeploymentSecret.generate()


def reg(role: str, incarnation: str) -> Registration:
    return Registration(role=role, incarnation=incarnation, control="127.0.0.1:9301", device="cpu", num_pages=64,
                        transport="tcp", endpoint="127.0.0.1:4000")


async def until(etcd: EtcdServer, want: set[str], timeout_s: float = 15) -> None:
    with anyio.fail_after(timeout_s):
        while True:
            try:
                if {r.incarnation for r in await registered_workers("127.0.0.1", etcd.port, SECRET)} == want:
                    return
            except ETCD_ERRORS:  # etcd not back yet: gRPC's connection backs off a while after a restart
                pass
            await anyio.sleep(0.1)


@pytest.fixture
def etcd(tmp_path: Path):  # type: ignore[no-untyped-def]
    server = EtcdServer(tmp_path)
    yield server
    server.stop()


@pytest.mark.anyio
async def test_a_registration_follows_the_incarnation_and_is_revoked_last(etcd: EtcdServer) -> None:
    current = reg("decode", "one")
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: register_worker("127.0.0.1", etcd.port, lambda: current, SECRET, ttl_s=3))
        await until(etcd, {"one"})
        current = reg("decode", "two")  # its scheduler went away: a new incarnation
        await until(etcd, {"two"})
        tg.cancel_scope.cancel()  # SIGTERM: the lease is revoked on the way out
    assert await registered_workers("127.0.0.1", etcd.port, SECRET) == []


@pytest.mark.anyio
async def test_the_registration_comes_back_after_etcd_restarts(etcd: EtcdServer, tmp_path: Path) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: register_worker("127.0.0.1", etcd.port, lambda: reg("prefill", "p1"), SECRET, ttl_s=2))
        await until(etcd, {"p1"})
        etcd.stop()
        await anyio.sleep(3)  # past the lease's TTL: etcd forgets it once it runs again
        await anyio.to_thread.run_sync(etcd.start)
        await until(etcd, {"p1"}, timeout_s=20)
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_a_front_end_waits_for_a_prefill_and_a_decode_worker(etcd: EtcdServer) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: register_worker("127.0.0.1", etcd.port, lambda: reg("prefill", "p"), SECRET, ttl_s=3))
        with pytest.raises(TimeoutError, match=r"found: prefill at 127.0.0.1:9301"):
            await find_workers("127.0.0.1", etcd.port, SECRET, wait_s=1.5)
        tg.start_soon(lambda: register_worker("127.0.0.1", etcd.port, lambda: reg("decode", "d"), SECRET, ttl_s=3))
        found = await find_workers("127.0.0.1", etcd.port, SECRET, wait_s=10)
        assert {(r.role, r.incarnation) for r in found} == {("prefill", "p"), ("decode", "d")}
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_a_deleted_or_overwritten_key_is_put_back_while_the_worker_lives(etcd: EtcdServer) -> None:
    mine = reg("decode", "alive")
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: register_worker("127.0.0.1", etcd.port, lambda: mine, SECRET, ttl_s=3))
        await until(etcd, {"alive"})
        async with etcd_client("127.0.0.1", etcd.port) as client:
            await client.delete(mine.key)
            assert await registered_workers("127.0.0.1", etcd.port, SECRET) == []
            await until(etcd, {"alive"}, timeout_s=5)  # back within a third of the TTL, and some
            await client.put(mine.key, b"{}")  # an etcd writer overwrites it
            await until(etcd, {"alive"}, timeout_s=5)
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_only_registrations_signed_for_their_own_key_are_listed(etcd: EtcdServer,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    genuine = reg("prefill", "real")
    forged = {  # what an etcd writer without the secret (or with a value it copied) can put
        PREFIX + b"decode/unsigned": msgspec.json.encode(reg("decode", "unsigned")),
        PREFIX + b"decode/stranger": signed_value(reg("decode", "stranger"), DeploymentSecret.generate()),
        PREFIX + b"decode/moved": signed_value(genuine, SECRET),  # a genuine value under another key
        PREFIX + b"decode/garbage": b"\xff not json",
    }
    async with etcd_client("127.0.0.1", etcd.port) as client:
        await client.put(genuine.key, signed_value(genuine, SECRET))
        for key, value in forged.items():
            await client.put(key, value)
    assert await registered_workers("127.0.0.1", etcd.port, SECRET) == [genuine]
    caplog.clear()
    with pytest.raises(TimeoutError, match=r"found: prefill at 127.0.0.1:9301\)"):  # no decode worker counts
        await find_workers("127.0.0.1", etcd.port, SECRET, wait_s=1.0)
    ignored = [r.getMessage() for r in caplog.records if "never dialled" in r.getMessage()]
    for key in forged:
        assert sum(key.decode() in m for m in ignored) == 1, ignored  # once, though it listed again and again
