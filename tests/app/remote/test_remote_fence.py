"""Across hosts the fence holds (the threat model in docs/architecture.md): workers on two hosts
(network namespaces), a front end here, a real etcd.

- a relay put at a worker's address (a redirected static address) that forwards the handshake
  reads nothing of what it carries (no prompt token id, no sampled token) and the first record
  it alters closes the connection;
- registrations an etcd writer forges (unsigned, or signed with another secret) are never dialled;
- SIGSTOP of a decode worker mid-stream: it is lost within the worker timeout (before its etcd
  lease could expire), its streams end with 503 worker_lost, the other decode worker serves on,
  pages return to baseline, and SIGCONT brings it back as a new incarnation;
- a silent partition of the decode host (its link taken down): both decode workers are lost within
  the timeout, and rejoin when the link comes back.
"""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import msgspec
import pytest
from remote_deployment import (STREAM_TOKENS, WORKER_TIMEOUT_S, Deployment, ServerProcess, all_served, at_baseline,
                               chat_references_hold, deployed, over_etcd, signalled_mid_stream, streams, until)
from tamper_relay import TO_CONNECTOR, TO_LISTENER, TamperingRelay

from kvfence.app.remote.membership import PREFIX, RELIST_S, Registration, etcd_client, signed_value
from kvfence.app.remote.protocol import HANDSHAKE_LABEL
from kvfence.transports.core.secret import DeploymentSecret


@pytest.fixture(scope="module")
def deployment(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    yield from deployed("tcp", default_model_path, tmp_path_factory.mktemp("fence-tcp"))


def control_needles(reference: dict, plain: bytes) -> list[bytes]:
    """How the cases' prompt ids (runs of four) and greedy ids appear in control messages in clear:
    those of them `plain` (what the relay's oracle opened) holds, at least one of each kind."""
    prompt, sampled = set(), set()
    for case in reference["cases"]:
        ids = case["prompt_token_ids"]
        prompt |= {",".join(map(str, ids[i:i + 4])).encode() for i in range(len(ids) - 3)}
        sampled |= {form.format(t).encode() for t in case["greedy_ids"] for form in ("[{}]", "[{},", ",{}]")}
    prompt, sampled = {n for n in prompt if n in plain}, {n for n in sampled if n in plain}
    assert prompt and sampled, "the oracle saw no prompt and no token: the check below would prove nothing"
    return sorted(prompt | sampled)


def test_a_relay_at_a_redirected_address_reads_nothing_and_alters_nothing(deployment: Deployment, reference: dict,
                                                                        tmp_path: Path, keylog: Path) -> None:
    """A front end whose static list names relays in place of the workers (redirected addresses,
    a forged list): the handshakes pass through them and the references are served, but the bytes
    they carried hold no prompt token id and no sampled token; the first record one of them alters
    closes its connection (an end says so) and that worker is lost. (The relay's oracle reads the
    key log the front end writes: the `keylog` fixture sets it for the processes started here.)"""
    prefill, decode = (next(w for w in deployment.workers if w.role == role) for role in ("prefill", "decode"))
    assert deployment.front.stop() == 0
    with TamperingRelay(prefill.control, keylog, HANDSHAKE_LABEL, lambda plain: "control") as to_prefill, \
            TamperingRelay(decode.control, keylog, HANDSHAKE_LABEL, lambda plain: "control") as to_decode:
        front = ServerProcess(deployment.model, "--discovery", f"static://{to_prefill.address},{to_decode.address}",
                              "--transport-secret-file", str(deployment.secret), "--front-key-file",
                              str(deployment.front_key), "--canary-interval", "3600",
                              "--worker-timeout", str(WORKER_TIMEOUT_S), log_path=tmp_path / "relayed.log")
        try:
            front.wait_ready()
            chat_references_hold(front, reference, per_kind=1)
            relays = (to_prefill, to_decode)
            plain = b"".join(bytes(r.plain[d]) for r in relays for d in (TO_LISTENER, TO_CONNECTOR))
            wire = b"".join(bytes(r.wire[d]) for r in relays for d in (TO_LISTENER, TO_CONNECTOR))
            assert not [n for n in control_needles(reference, plain) if n in wire]
            to_decode.kind = "control"  # its next record to the worker (a step or a ping) is altered
            until(lambda: "failed authentication" in decode.log(), 30, "the altered record closed the connection")
            until(lambda: f"decode@{to_decode.address} was lost" in front.log(), 30, "the relayed worker lost")
        finally:
            front.stop()
    deployment.front = deployment.start_front()
    deployment.front.wait_ready()
    chat_references_hold(deployment.front, reference, per_kind=1)


def test_a_forged_registration_is_never_dialled(deployment: Deployment, reference: dict) -> None:
    """An etcd writer without the secret registers a "decode worker" at an address it listens on,
    unsigned and signed with another secret: the front end logs each once and never connects."""
    over_etcd(deployment)
    trap = socket.create_server(("127.0.0.1", 0))
    trap.settimeout(0.2)
    control = f"127.0.0.1:{trap.getsockname()[1]}"
    fake = Registration(role="decode", incarnation="f" * 32, control=control, device="cpu", num_pages=512,
                        transport="tcp", endpoint=control)
    forged = {fake.key: msgspec.json.encode(fake),
              PREFIX + b"decode/" + b"e" * 32: signed_value(msgspec.structs.replace(fake, incarnation="e" * 32),
                                                         DeploymentSecret.generate())}

    async def put() -> None:
        async with etcd_client("127.0.0.1", deployment.etcd.port) as client:
            for key, value in forged.items():
                await client.put(key, value)

    with trap:
        anyio.run(put)
        until(lambda: all(f"etcd key {key.decode()} is ignored, never dialled" in deployment.front.log()
                          for key in forged), 30, "both forged registrations refused")
        time.sleep(2 * RELIST_S)  # listed again and again meanwhile
        with pytest.raises(TimeoutError):
            trap.accept()
    all_served(deployment.front, reference, 2)


def silenced(deployment: Deployment, front_log_at: int) -> str:
    """What the front end logged about control connections since `front_log_at`."""
    return "\n".join(line for line in deployment.front.log()[front_log_at:].splitlines()
                     if "control connection to the worker" in line)


def test_sigstop_of_a_decode_worker_mid_stream(deployment: Deployment, reference: dict) -> None:
    """It stops answering: within the worker timeout (before its etcd lease could expire) it is
    lost, its streams end with 503 worker_lost (or were retried before a token), the other decode
    worker serves on, and pages return to baseline; SIGCONT brings it back as a new incarnation."""
    over_etcd(deployment)
    until(lambda: all(deployment.paired(w) for w in deployment.workers[1:]), 60, "both decode workers paired")
    mark = len(deployment.front.log())
    victim, running = None, []
    try:
        victim, running = signalled_mid_stream(deployment, reference, signal.SIGSTOP)
        lost = [s for s in running if s.error is not None]
        assert lost, "no stream was on the stopped worker"
        for s in lost:
            assert "worker" in str(s.error) and "lost" in str(s.error), s.error
        for s in running:
            assert s.text.startswith(s.case["text_until_eos"]) or s.case["text_until_eos"].startswith(s.text)
        assert f"the worker at {victim.control} is gone: nothing heard from it" in silenced(deployment, mark)
        at_baseline(deployment.front)
        all_served(deployment.front, reference, 4)  # the other decode worker serves everything
    finally:
        if victim is not None:
            victim.proc.send_signal(signal.SIGCONT)
    until(lambda: deployment.front.log().count(f"-> the decode worker at {victim.control} over") >= 2, 60,
          "the resumed worker paired again, as a new incarnation")
    all_served(deployment.front, reference, 4)
    at_baseline(deployment.front)


def test_a_silent_partition_of_the_decode_host(deployment: Deployment, reference: dict) -> None:
    """The decode host's link to the front end goes down (no reset, no FIN): within the worker
    timeout both decode workers are lost and their streams end; when the link comes back they
    rejoin as new incarnations and serve exactly."""
    over_etcd(deployment)
    until(lambda: all(deployment.paired(w) for w in deployment.workers[1:]), 60, "both decode workers paired")
    decode = [w for w in deployment.workers if w.role == "decode"]
    mark, paired_before = len(deployment.front.log()), deployment.front.log().count("-> the decode worker at")
    running = streams(deployment.front, reference, 4, STREAM_TOKENS)
    for s in running:
        assert s.started.wait(120)
    deployment.hosts.control_link("decode", up=False)
    try:
        for s in running:
            s.join(60)
            assert not s.is_alive() and s.error is not None and "lost" in str(s.error), s.error
        until(lambda: all(f"the worker at {w.control} is gone: nothing heard from it" in silenced(deployment, mark)
                          for w in decode), 4 * WORKER_TIMEOUT_S, "both decode workers lost by the keep-alive")
        at_baseline(deployment.front)
    finally:
        deployment.hosts.control_link("decode", up=True)
    until(lambda: deployment.front.log().count("-> the decode worker at") >= paired_before + len(decode), 90,
          "both decode workers paired again")
    all_served(deployment.front, reference, 4)
    at_baseline(deployment.front)

