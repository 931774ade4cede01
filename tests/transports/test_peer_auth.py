"""The trust boundary of the transports (FAILURES 22): a process outside the deployment that
connects to an endpoint and speaks its protocol gets nothing — no record, no data-plane
descriptor, no page byte — and a replayed handshake or a wrong secret fails the same way; plus
the handshake timeout, the connection cap and the keep-alive of every listening transport."""

from __future__ import annotations

import hashlib
import hmac
import socket
import stat

import anyio
import msgspec
import pytest
import torch
from flood import connect
from transport_harness import (LISTENING, TEST_FRONT, TEST_SECRET, MooncakeStranger, make_manifest, make_record, paired,
                               raw_authenticate, recv_exactly, recv_until_closed, signed)

from kvfence.transports.base import EndpointInfo
from kvfence.transports.core.front_key import FrontKey, capability_message
from kvfence.transports.core.secret import MAC_BYTES, NONCE_BYTES, PART_BYTES, AuthenticationFailed, DeploymentSecret
from kvfence.transports.tcp.wire import Frame
from kvfence.transports.wire.framing import LEN_SIZE, decode_frame, encode_frame, frame_length
from kvfence.transports.wire.handshake import MAGIC, contribution, opening
from kvfence.transports.wire.messages import Hello, HelloReply, Page, Ping, PushHeader

pytestmark = pytest.mark.anyio
STRANGER = DeploymentSecret.generate()  # a process that is not part of the test deployment


def hello_frame(kind: str) -> bytes:
    """A Hello with a record that matches the receiver's: all the public model file gives."""
    return encode_frame(Hello(EndpointInfo(kind, "127.0.0.1:1", make_record())))


def frames(data: bytes) -> list[object]:
    out = []
    while data:
        n = frame_length(data[:LEN_SIZE])
        out.append(decode_frame(data[LEN_SIZE:LEN_SIZE + n], Frame))
        data = data[LEN_SIZE + n:]
    return out


def stranger_pushes(address: str, kind: str, manifest, dst_pages: list[int], page_nbytes: int) -> tuple[bytes, bytes]:
    """Blocking: a stranger runs the handshake with its own secret, then speaks the protocol as a
    paired sender would (Hello, a push of an expected transfer with page bytes). Returns what it
    got during the handshake and everything after it."""
    with connect(address) as s:
        mine, _ = contribution()
        s.sendall(opening(mine))
        answer = recv_exactly(s, PART_BYTES + MAC_BYTES)
        s.sendall(STRANGER.proof("connector", kind, mine, answer[:PART_BYTES]))
        try:
            s.sendall(hello_frame(kind) + encode_frame(PushHeader(manifest=manifest, dst_pages=dst_pages,
                                                                  page_nbytes=page_nbytes))
                      + encode_frame(Page(0)) + b"\xab" * page_nbytes)
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed on us: that is the point
        return answer, recv_until_closed(s)


@pytest.mark.parametrize("kind", LISTENING)
async def test_a_stranger_with_a_valid_record_gets_nothing_and_lands_nothing(kind: str) -> None:
    async with paired(kind) as p:
        manifest = p.arm(make_manifest(1), [3])  # a real transfer is armed: the stranger aims at it
        answer, after = await anyio.to_thread.run_sync(stranger_pushes, p.rx_info.address, kind, manifest, [3],
                                                       p.dst[0].numel() * 4)
        assert after == b""  # no HelloReply: no record, no plane descriptor
        assert len(answer) == PART_BYTES + MAC_BYTES and make_record().model.encode() not in answer
        p.assert_untouched()
        assert p.rx.refused_peers == 1
        assert p.peer is not None  # the deployment's own pair still works
        result = await p.tx.push(p.peer, manifest, [0], [3])
        assert result.ok, result
        p.assert_landed([0], [3])


async def test_a_stranger_at_the_mooncake_engines_own_ports_gets_no_page_byte() -> None:
    """The Mooncake engine listens on ports of its own, beside the authenticated pairing: a
    handshake that answers anyone with the addresses of what is registered, and a data port that
    reads and writes whatever is. So over tcp nothing of either pool is registered but a push's
    dst pages while it is in flight: before and after a push a stranger reads none of its pages
    on either side, and writes none."""
    pytest.importorskip("mooncake.engine")
    async with paired("mooncake") as p:
        page_nbytes = p.dst[0].numel() * p.dst.element_size()
        assert page_nbytes == MooncakeStranger.PAGE

        # a fresh stranger for each look: an engine stops trying a session after a few refusals
        def reach(stranger: MooncakeStranger, when: str) -> None:
            for plane, pool, (read_page, write_page) in ((p.rx.plane, p.dst, (9, 1)), (p.tx.plane, p.src, (3, 4))):
                base = pool.data_ptr()
                assert stranger.read(plane.session_id, base + read_page * page_nbytes) < 0, when
                assert stranger.write(plane.session_id, base + write_page * page_nbytes) < 0, when

        src = p.src.clone()
        before, after = MooncakeStranger(), MooncakeStranger()
        await anyio.to_thread.run_sync(reach, before, "before")
        _, result = await p.expect_and_push([3, 4], [9, 1])
        assert result.ok, result
        await anyio.to_thread.run_sync(reach, after, "after")
        assert bool((before.buffer == 0xAB).all()) and bool((after.buffer == 0xAB).all())  # no byte read
        p.assert_landed([3, 4], [9, 1])  # and none written: the pools hold exactly the push
        assert torch.equal(p.src, src)


@pytest.mark.parametrize("kind", LISTENING)
async def test_a_hello_without_the_handshake_gets_no_byte(kind: str) -> None:
    async with paired(kind, pair=False) as p:
        def exchange() -> bytes:
            with connect(p.rx_info.address) as s:
                s.sendall(hello_frame(kind))
                return recv_until_closed(s)

        assert await anyio.to_thread.run_sync(exchange) == b""
        assert p.rx.refused_peers == 1


@pytest.mark.parametrize("kind", LISTENING)
async def test_a_replayed_handshake_fails(kind: str) -> None:
    async with paired(kind, pair=False) as p:
        def record_then_replay() -> tuple[bytes, bytes, bytes]:
            with connect(p.rx_info.address) as s:  # a real member's handshake, recorded on the wire
                mine, _ = contribution()
                s.sendall(opening(mine))
                first = recv_exactly(s, PART_BYTES + MAC_BYTES)
                proof = TEST_SECRET.proof("connector", kind, mine, first[:PART_BYTES])
                s.sendall(proof)
            with connect(p.rx_info.address) as s:  # replayed byte for byte
                s.sendall(opening(mine))
                second = recv_exactly(s, PART_BYTES + MAC_BYTES)
                s.sendall(proof + hello_frame(kind))
                return first, second, recv_until_closed(s)

        first, second, after = await anyio.to_thread.run_sync(record_then_replay)
        assert first[:NONCE_BYTES] != second[:NONCE_BYTES]  # a fresh challenge every time
        assert after == b""
        assert p.rx.refused_peers == 1  # the recorded session itself authenticated (then hung up)


@pytest.mark.parametrize("kind", LISTENING + ["inprocess"])
async def test_the_connecting_side_refuses_a_listener_without_the_secret(kind: str) -> None:
    async with paired(kind, pair=False) as p:
        async with anyio.create_task_group() as tg:
            from transport_harness import make_transport

            outsider = make_transport(kind, p.hub, p.dst[0].numel() * 4, secret=STRANGER)
            info = await outsider.start(tg, p.dst.clone(), make_record(p.dst[0].numel() * 4))
            with pytest.raises(AuthenticationFailed):
                await p.tx.pair(info)
            await outsider.aclose()


async def test_a_listener_that_does_not_prove_the_secret_hears_no_hello() -> None:
    """The connector checks the listener's proof before it says anything about itself."""
    listener = socket.create_server(("127.0.0.1", 0))
    got: list[bytes] = []

    def fake_listener() -> None:
        conn, _ = listener.accept()
        with conn:
            hello = recv_exactly(conn, len(MAGIC) + PART_BYTES)
            mine, _ = contribution()
            conn.sendall(mine + STRANGER.proof("listener", "tcp", hello[len(MAGIC):], mine))
            got.append(hello + recv_until_closed(conn))

    with listener:
        async with paired("tcp", pair=False) as p, anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, fake_listener)
            with pytest.raises(AuthenticationFailed):
                await p.tx.pair(EndpointInfo("tcp", f"127.0.0.1:{listener.getsockname()[1]}", make_record()))
    assert len(got[0]) == len(MAGIC) + PART_BYTES  # its opening, then nothing: no record


@pytest.mark.parametrize("kind", LISTENING)
async def test_a_handshake_that_does_not_complete_is_closed(kind: str) -> None:
    async with paired(kind, pair=False, handshake_timeout_s=0.3) as p:
        def slow() -> tuple[bytes, bytes]:
            with connect(p.rx_info.address) as silent, connect(p.rx_info.address) as half:
                half.sendall(MAGIC)  # a few bytes of the opening, then nothing
                return recv_until_closed(silent), recv_until_closed(half)

        assert await anyio.to_thread.run_sync(slow) == (b"", b"")


@pytest.mark.parametrize("kind", LISTENING)
async def test_a_paired_peer_that_goes_silent_is_closed_and_an_idle_pair_is_kept(kind: str) -> None:
    async with paired(kind, keepalive_s=0.4) as p:
        def silent_member() -> bytes:
            with connect(p.rx_info.address) as s:
                sealed = raw_authenticate(s, transport=kind)
                sealed.sendall(hello_frame(kind))
                return sealed.recv_until_closed()  # never pings back

        received = await anyio.to_thread.run_sync(silent_member)
        reply, *rest = frames(received)
        assert isinstance(reply, HelloReply) and reply.accepted
        assert rest and all(isinstance(f, Ping) for f in rest)  # pinged, then closed for its silence
        await anyio.sleep(1.6)  # four keep-alive bounds with nothing to send
        assert await p.tx.health() and await p.rx.health()
        _, result = await p.expect_and_push([4], [5])
        assert result.ok, result


def test_the_secret_file_must_be_long_enough_and_is_never_shown(tmp_path) -> None:
    short = tmp_path / "short"
    short.write_bytes(b"x" * 31)
    with pytest.raises(ValueError, match=f"{short}.*at least 32 bytes"):
        DeploymentSecret.from_file(short)
    with pytest.raises(ValueError, match="cannot read"):
        DeploymentSecret.from_file(tmp_path / "missing")
    good = tmp_path / "good"
    good.write_bytes(b"k" * 44 + b"\n")
    good.chmod(stat.S_IRUSR | stat.S_IWUSR)
    secret = DeploymentSecret.from_file(good)
    assert "k" not in repr(secret)
    same_key = DeploymentSecret(b"k" * 44)
    assert secret.proof("listener", "tcp", b"a", b"b") == same_key.proof("listener", "tcp", b"a", b"b")


def test_a_proof_is_bound_to_role_transport_and_both_nonces() -> None:
    base = TEST_SECRET.proof("listener", "tcp", b"n1", b"n2")
    assert base != TEST_SECRET.proof("connector", "tcp", b"n1", b"n2")  # no reflection
    assert base != TEST_SECRET.proof("listener", "nixl", b"n1", b"n2")
    assert base != TEST_SECRET.proof("listener", "tcp", b"n3", b"n2")
    assert base != STRANGER.proof("listener", "tcp", b"n1", b"n2")


def test_a_capability_covers_every_field_it_names() -> None:
    manifest = make_manifest(2)
    info = EndpointInfo("tcp", "x:1", make_record())
    cap = signed(manifest, [3, 4], info).capability
    others = [signed(msgspec.structs.replace(manifest, **{f: "y"}), [3, 4], info).capability
              for f in ("transfer_id", "lease", "nonce")]
    others += [signed(manifest, [3, 5], info).capability, signed(manifest, [34], info).capability,
               signed(msgspec.structs.replace(manifest, num_tokens=1), [3, 4], info).capability,
               signed(manifest, [3, 4], EndpointInfo("tcp", "x:1", make_record())).capability,
               signed(manifest, [3, 4], info, FrontKey.generate()).capability]
    assert cap not in others and len(set(others)) == len(others)
    incarnation = info.record.incarnation
    assert TEST_FRONT.public.capability_ok(signed(manifest, [3, 4], info), [3, 4], incarnation)
    assert not TEST_FRONT.public.capability_ok(manifest, [3, 4], incarnation)  # unsigned
    for forged in (signed(manifest, [3, 4], info, FrontKey.generate()).capability,  # another front key
                   cap[:-2] + ("00" if cap[-2:] != "00" else "01"), cap[:64], "zz" * 64, cap + "00"):
        assert not TEST_FRONT.public.capability_ok(msgspec.structs.replace(manifest, capability=forged), [3, 4],
                                                   incarnation)
    # what a worker host holds (the deployment secret, the public key) makes no capability: a MAC
    # keyed with anything it knows is not a signature the front end's public key verifies
    for key in (b"k" * 32, TEST_FRONT.public.raw()):
        mac = hmac.digest(key, capability_message(manifest, [3, 4], incarnation), hashlib.sha512).hex()
        assert not TEST_FRONT.public.capability_ok(msgspec.structs.replace(manifest, capability=mac), [3, 4],
                                                   incarnation)
