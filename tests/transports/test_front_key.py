"""Roles (transports/core/front_key.py, transports/wire/handshake.py): a worker host holds the
deployment secret and the front end's public key, and with them can pose as no front end. A
control connection whose connector does not sign the handshake with the front end's key is refused;
a member in the path that swaps the ephemeral keys (so it could read what follows) breaks that
signature; the key files are checked where they are read."""

from __future__ import annotations

import functools
import os
import socket
import stat
from pathlib import Path

import anyio
import pytest
from transport_harness import TEST_FRONT, TEST_SECRET

from kvfence.transports.core.front_key import FrontKey, FrontPublicKey
from kvfence.transports.core.secret import MAC_BYTES, PART_BYTES, AuthenticationFailed
from kvfence.transports.wire.channel import Channel
from kvfence.transports.wire.handshake import MAGIC, authenticate_as_connector, authenticate_as_listener, contribution

pytestmark = pytest.mark.anyio
LABEL = "control"
SIGNED = MAC_BYTES + 64  # a control connector's last message: its proof and the front end's signature


def connected() -> tuple[Channel, Channel]:
    """Two ends of a loopback TCP connection."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    return Channel(a), Channel(b)


async def as_worker(worker: Channel, refused: list[BaseException]) -> None:
    """A worker's end of a control handshake, trusting TEST_FRONT; its refusal goes to `refused`."""
    try:
        await authenticate_as_listener(worker, TEST_SECRET, LABEL, front=TEST_FRONT.public)
    except AuthenticationFailed as e:
        refused.append(e)


async def handshake(front_key: FrontKey) -> tuple[Channel, Channel, BaseException | None]:
    """A front end holding `front_key` opens a control connection to a worker that trusts TEST_FRONT:
    (front end's channel, worker's channel, what the worker raised)."""
    front, worker = connected()
    refused: list[BaseException] = []
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(as_worker, worker, refused)
            await authenticate_as_connector(front, TEST_SECRET, LABEL, front_key=front_key)
    return front, worker, refused[0] if refused else None


async def test_only_the_front_end_key_opens_a_control_connection() -> None:
    front, worker, refused = await handshake(TEST_FRONT)
    assert refused is None and front.sealed and worker.sealed
    front.close()
    worker.close()
    # the deployment secret and a key of its own: all a worker host could sign with
    front, worker, refused = await handshake(FrontKey.generate())
    assert isinstance(refused, AuthenticationFailed) and "did not prove the front end's key" in str(refused)
    assert not worker.sealed
    for channel in (front, worker):
        channel.close()


async def test_a_member_in_the_path_that_swaps_the_ephemeral_keys_is_refused_by_the_worker() -> None:
    """A worker host between the front end and another worker holds the deployment secret, so it
    can make either end's proof over contributions of its own choosing: it swaps in its own
    ephemeral keys on both sides (to share a key with each end and read everything). The front end's
    signature covers the contributions it saw, not those the worker saw: the worker refuses."""
    front, mitm_front = connected()
    mitm_worker, worker = connected()
    refused: list[BaseException] = []

    async def in_the_path() -> None:
        front_part = (await mitm_front.recv_clear(len(MAGIC) + PART_BYTES))[len(MAGIC):]
        own_c, _ = contribution()
        to_worker = front_part[:-32] + own_c[-32:]  # the front end's nonce, its own key
        async with mitm_worker.send_lock:
            await mitm_worker.send_clear(MAGIC + to_worker)
        worker_part = (await mitm_worker.recv_clear(PART_BYTES + MAC_BYTES))[:PART_BYTES]
        own_l, _ = contribution()
        to_front = worker_part[:-32] + own_l[-32:]
        async with mitm_front.send_lock:
            await mitm_front.send_clear(to_front + TEST_SECRET.proof("listener", LABEL, front_part, to_front))
        signature = (await mitm_front.recv_clear(SIGNED))[MAC_BYTES:]
        async with mitm_worker.send_lock:
            await mitm_worker.send_clear(TEST_SECRET.proof("connector", LABEL, to_worker, worker_part) + signature)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(as_worker, worker, refused)
            tg.start_soon(in_the_path)
            await authenticate_as_connector(front, TEST_SECRET, LABEL, front_key=TEST_FRONT)
    assert front.sealed  # the front end was fooled into a session with the member...
    assert refused and "did not prove the front end's key" in str(refused[0])  # ...the worker was not
    assert not worker.sealed
    for channel in (front, mitm_front, mitm_worker, worker):
        channel.close()


async def test_a_kv_connection_is_not_a_control_connection() -> None:
    """A member that opens the worker's control port with a KV transport's handshake (no
    signature) gets no session: the worker waits for the signature until its handshake timeout."""
    front, worker = connected()
    with anyio.move_on_after(1):
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(authenticate_as_listener, worker, TEST_SECRET, LABEL,
                                            front=TEST_FRONT.public))
            await authenticate_as_connector(front, TEST_SECRET, LABEL)
    assert not worker.sealed
    front.close()
    worker.close()


def test_key_files_round_trip_and_bad_ones_are_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    key = FrontKey.generate()
    private, public = tmp_path / "front.key", tmp_path / "front.pub"
    key.write(private, public)
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    with pytest.raises(ValueError, match="never overwritten"):
        key.write(tmp_path / "other.key", public)
    loaded, verifier = FrontKey.from_file(private), FrontPublicKey.from_file(public)
    assert verifier.raw() == key.public.raw() == loaded.public.raw()
    assert verifier.control_ok(loaded.sign_control(b"t"), b"t")
    assert not verifier.control_ok(key.sign_control(b"t"), b"u")
    assert "BEGIN" not in repr(loaded) and key.public.fingerprint in repr(loaded)
    private.chmod(0o644)
    FrontKey.from_file(private)
    assert "can be read by other users" in caplog.text
    with pytest.raises(ValueError, match=f"--front-key-file {public}: not an unencrypted Ed25519 private key"):
        FrontKey.from_file(public)
    with pytest.raises(ValueError, match=f"--front-public-key-file {private}: not an Ed25519 public key"):
        FrontPublicKey.from_file(private)
    garbage = tmp_path / "garbage"
    garbage.write_bytes(os.urandom(64))
    with pytest.raises(ValueError, match="not an Ed25519 public key"):
        FrontPublicKey.from_file(garbage)
    with pytest.raises(ValueError, match="cannot read it"):
        FrontPublicKey.from_file(tmp_path / "missing")
