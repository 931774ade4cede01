#!/usr/bin/env python
"""What peer authentication and push capabilities cost, on one machine (loopback).

Measures, each as the median over many repetitions:
  capability   minting a push's capability (what TransferLink.move adds per transfer) and checking
               it (what the receiver adds, twice: at `expect` and at admission), for a 1-page and a
               128-page (2,048-token) transfer
  handshake    the HMAC work of one authentication (both proofs and both checks), in-process
  pair         `pair()` of two endpoints of a transport over loopback (connect, authenticate both
               ways, exchange pairing records), against a raw TCP connect plus one round trip of
               the same bytes without the HMACs (`connect+rtt`), so the difference is what the
               authentication adds
  push         a 1-page push through tcp end to end (expect, push, verdict), for scale

Usage: .venv/bin/python scripts/bench_auth.py [--transports tcp,nixl,mooncake] [--repeat 200]
"""

from __future__ import annotations

import argparse
import secrets
import socket
import statistics
import threading
import time

import anyio
import msgspec
import torch

from kvfence.app.config.config import PoolsConfig
from kvfence.transports.base import PairingRecord, TransferManifest, TransportUnavailable
from kvfence.transports.core.front_key import FrontKey
from kvfence.transports.core.secret import MAC_BYTES, PART_BYTES, DeploymentSecret
from kvfence.transports.registry import create_transport
from kvfence.transports.wire.handshake import MAGIC, contribution, shared_secret, transcript

SECRET = DeploymentSecret.generate()
FRONT = FrontKey.generate()
PAGE_TOKENS = PoolsConfig().page_size_tokens  # the default page size
PAGE_NBYTES = 46_080 * PAGE_TOKENS  # one fp32 page of the default model


def median_us(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def manifest_for(num_pages: int) -> TransferManifest:
    return TransferManifest(transfer_id=secrets.token_hex(16), lease=secrets.token_hex(16), nonce=secrets.token_hex(16),
                            num_tokens=num_pages * PAGE_TOKENS, num_pages=num_pages)


def bench_capability(repeat: int) -> None:
    incarnation = secrets.token_hex(16)
    for num_pages in (1, 128):
        m = manifest_for(num_pages)
        pages = list(range(num_pages))
        mint = median_us(lambda: FRONT.capability(m, pages, incarnation), repeat)
        signed = msgspec.structs.replace(m, capability=FRONT.capability(m, pages, incarnation))
        check = median_us(lambda: FRONT.public.capability_ok(signed, pages, incarnation), repeat)
        print(f"capability, {num_pages:>3} pages: mint {mint:6.1f} us, check {check:6.1f} us "
              f"(per transfer: one mint + one check = {mint + check:6.1f} us; a push identical to "
              f"what was armed is not checked again)")


def bench_handshake_math(repeat: int) -> None:
    def once(front: bool) -> None:
        (nc, kc), (nl, kl) = contribution(), contribution()
        a = SECRET.proof("listener", "tcp", nc, nl)
        SECRET.proves(a, "listener", "tcp", nc, nl)
        b = SECRET.proof("connector", "tcp", nc, nl)
        SECRET.proves(b, "connector", "tcp", nc, nl)
        SECRET.session_keys("tcp", nc, nl, shared_secret(kc, nl))
        SECRET.session_keys("tcp", nc, nl, shared_secret(kl, nc))
        if front:
            FRONT.public.control_ok(FRONT.sign_control(transcript("control", nc, nl)), transcript("control", nc, nl))

    print(f"handshake work, both ends (contributions, X25519, proofs, session keys): "
          f"{median_us(lambda: once(False), repeat):6.1f} us; control, with the front end's signature: "
          f"{median_us(lambda: once(True), repeat):6.1f} us")


def raw_connect_rtt(repeat: int) -> float:
    """A TCP connect plus the handshake's bytes both ways, without any HMAC (the floor)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        for _ in range(repeat):
            conn, _ = listener.accept()
            with conn:
                conn.recv(len(MAGIC) + PART_BYTES, socket.MSG_WAITALL)
                conn.sendall(bytes(PART_BYTES + MAC_BYTES))
                conn.recv(MAC_BYTES, socket.MSG_WAITALL)
                conn.sendall(b"x")

    thread = threading.Thread(target=serve)
    thread.start()

    def once() -> None:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.sendall(bytes(len(MAGIC) + PART_BYTES))
            s.recv(PART_BYTES + MAC_BYTES, socket.MSG_WAITALL)
            s.sendall(bytes(MAC_BYTES))
            s.recv(1)

    result = median_us(once, repeat)
    thread.join()
    listener.close()
    return result


async def bench_pair(name: str, repeat: int) -> None:
    record = PairingRecord(model="bench@1", dtype="float32", page_size_tokens=PAGE_TOKENS, page_nbytes=PAGE_NBYTES,
                           page_layout="pages,layers,kv,kv_heads,page_size,head_dim", digest="xxh3_64",
                           max_context_tokens=8192, incarnation=secrets.token_hex(8))
    src, dst = torch.randn(4, PAGE_NBYTES // 4), torch.zeros(4, PAGE_NBYTES // 4)
    try:
        tx, rx = (create_transport(name, secret=SECRET, front_key=FRONT.public),
                  create_transport(name, secret=SECRET, front_key=FRONT.public))
    except TransportUnavailable as e:
        print(f"pair {name}: not installed ({e})")
        return
    async with anyio.create_task_group() as tg:
        rx_info = await rx.start(tg, dst, record)
        await tx.start(tg, src, record)
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            peer = await tx.pair(rx_info)
            times.append(time.perf_counter() - t0)
        pushes = []
        for _ in range(repeat if name == "tcp" else 0):
            m = manifest_for(1)
            m = msgspec.structs.replace(m, capability=FRONT.capability(m, [1], rx_info.record.incarnation))
            t0 = time.perf_counter()
            rx.expect(m, [1])
            assert (await tx.push(peer, m, [0], [1])).ok
            assert (await rx.completion(m.transfer_id)).ok
            pushes.append(time.perf_counter() - t0)
        await tx.aclose()
        await rx.aclose()
    print(f"pair {name}: {statistics.median(times) * 1e3:6.2f} ms per pair() (median of {repeat})")
    if pushes:
        print(f"push tcp, 1 page end to end: {statistics.median(pushes) * 1e6:6.0f} us")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--transports", default="tcp,nixl,mooncake")
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    bench_capability(args.repeat * 10)
    bench_handshake_math(args.repeat * 10)
    print(f"connect+rtt (raw TCP, the handshake's bytes, no HMAC): {raw_connect_rtt(args.repeat):6.1f} us")
    for name in args.transports.split(","):
        anyio.run(bench_pair, name, args.repeat if name == "tcp" else max(10, args.repeat // 10))


if __name__ == "__main__":
    main()
