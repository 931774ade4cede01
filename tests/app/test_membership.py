"""Worker membership in a real etcd (app/membership.py): a worker's key lives under a lease it
keeps alive, a new incarnation replaces it, SIGTERM's revoke removes it at once, and after etcd
restarts the registration comes back by itself. A front end waiting for workers says what it
found when they do not come."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from etcd_server import EtcdServer

from kvfence.app.membership import ETCD_ERRORS, Registration, find_workers, register_worker, registered_workers


def reg(role: str, incarnation: str) -> Registration:
    return Registration(role, incarnation, "127.0.0.1:9301", "cpu", 64, "tcp", "127.0.0.1:4000")


async def until(etcd: EtcdServer, want: set[str], timeout_s: float = 15) -> None:
    with anyio.fail_after(timeout_s):
        while True:
            try:
                if {r.incarnation for r in await registered_workers("127.0.0.1", etcd.port)} == want:
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
        tg.start_soon(lambda: register_worker("127.0.0.1", etcd.port, lambda: current, ttl_s=3))
        await until(etcd, {"one"})
        current = reg("decode", "two")  # its scheduler went away: a new incarnation
        await until(etcd, {"two"})
        tg.cancel_scope.cancel()  # SIGTERM: the lease is revoked on the way out
    assert await registered_workers("127.0.0.1", etcd.port) == []


@pytest.mark.anyio
async def test_the_registration_comes_back_after_etcd_restarts(etcd: EtcdServer, tmp_path: Path) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: register_worker("127.0.0.1", etcd.port, lambda: reg("prefill", "p1"), ttl_s=2))
        await until(etcd, {"p1"})
        etcd.stop()
        await anyio.sleep(3)  # past the lease's TTL: etcd forgets it once it runs again
        await anyio.to_thread.run_sync(etcd.start)
        await until(etcd, {"p1"}, timeout_s=20)
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_a_front_end_waits_for_a_prefill_and_a_decode_worker(etcd: EtcdServer) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: register_worker("127.0.0.1", etcd.port, lambda: reg("prefill", "p"), ttl_s=3))
        with pytest.raises(TimeoutError, match=r"found: prefill at 127.0.0.1:9301"):
            await find_workers("127.0.0.1", etcd.port, wait_s=1.5)
        tg.start_soon(lambda: register_worker("127.0.0.1", etcd.port, lambda: reg("decode", "d"), ttl_s=3))
        found = await find_workers("127.0.0.1", etcd.port, wait_s=10)
        assert {(r.role, r.incarnation) for r in found} == {("prefill", "p"), ("decode", "d")}
        tg.cancel_scope.cancel()
