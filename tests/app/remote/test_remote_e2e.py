"""Prefill and decode workers each in their own process on its own host (`kvfence worker` in a
network namespace of its own, tests/netns.py), driven by a front end in a third (`kvfence serve`
here): the KV crosses from the prefill host to the decode host over their veth link, over tcp,
nixl and mooncake, and answers equal the greedy references through the official openai client.
Stopping the front end ends its leases on every worker; a new front end serves exactly again.

Over tcp the workers register in a real etcd (`--discovery etcd://`), and the decode host runs two
decode workers (one per GPU, as it were), both paired with the prefill worker. There, also:

- a front end without the deployment secret gets nothing from the workers;
- `kvfence status` lists every worker with its pool and health;
- a decode worker whose pool disagrees on the bytes (bfloat16) is refused at pairing, as a whole;
- `kill -9` of a decode worker mid-stream: its streams end with a 503 worker_lost error (none
  reports success), every other stream answers the reference, the front end stays ready, the
  survivors' pages return to baseline, the surviving decode worker serves every request after,
  and `kvfence status` stops listing the dead one within the lease TTL (FAILURES 29);
- a decode worker that joins while serving is paired and serves;
- etcd restarted under load: serving goes on, membership recovers (every worker registers again,
  and a worker that joins after it is found) (FAILURES 30);
- SIGTERM on a decode worker drains it: its streams finish, it takes nothing new, exits 0 and its
  registration is revoked.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from remote_deployment import (STREAM_TOKENS, Deployment, ServerProcess, all_served, at_baseline, chat_references_hold,
                               deployed, front_key_files, over_etcd, secret_file, signalled_mid_stream, status, streams,
                               until, wait_baseline)


@pytest.fixture(scope="module", params=["tcp", "nixl", "mooncake"])
def deployment(request: pytest.FixtureRequest, default_model_path: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    yield from deployed(request.param, default_model_path, tmp_path_factory.mktemp(f"remote-{request.param}"))


def test_workers_in_their_own_processes_serve_the_references(deployment: Deployment, reference: dict) -> None:
    chat_references_hold(deployment.front, reference)
    wait_baseline(deployment.front)
    moved = deployment.front.metric("kvfence_kv_transfers_total", result="ok")
    assert moved >= len(reference["cases"])  # every prompt's KV crossed from one process to the other
    log = deployment.front.log()
    if deployment.etcd is not None:
        assert "etcd at" in log and "lists 3 workers" in log, log
    assert re.search(rf"paired the prefill worker at \S+ -> the decode worker at \S+ over {deployment.transport}",
                     log), log


def test_a_new_front_end_serves_after_the_last_one_left(deployment: Deployment, reference: dict) -> None:
    """The workers end every lease of a front end that went away (pages untagged and poisoned, a
    new incarnation, a fresh KV endpoint), and pair again with the next one."""
    assert deployment.front.stop() == 0
    deployment.front = deployment.start_front()
    deployment.front.wait_ready()
    for w in deployment.workers:
        assert re.search(r"the scheduler at \S+ is gone; its leases ended", w.log()), w.log()
    chat_references_hold(deployment.front, reference, per_kind=2)  # all of them: the first test
    wait_baseline(deployment.front)


@pytest.mark.parametrize("holds", ["another secret", "the secret, not the front key"])
def test_a_front_end_without_its_credentials_gets_nothing(deployment: Deployment, tmp_path: Path, holds: str) -> None:
    """While one front end owns the workers, a second with the wrong deployment secret, or with the
    secret but a front key of its own (all a compromised worker host could hold), fails the
    handshake and exits 1; the workers log the refusal and keep serving the first."""
    over_etcd(deployment)
    secret = secret_file(tmp_path) if holds == "another secret" else deployment.secret
    own_key, _ = front_key_files(tmp_path, "own")
    discovery = "static://" + ",".join(w.control for w in deployment.workers)
    stranger = ServerProcess(deployment.model, "--discovery", discovery, "--transport-secret-file", str(secret),
                             "--front-key-file", str(own_key), log_path=tmp_path / "stranger.log")
    assert stranger.proc.wait(120) == 1
    if holds == "another secret":
        assert "did not prove the deployment secret" in stranger.log(), stranger.log()
    # with another secret, the front end is the one that hangs up (the worker's proof fails there)
    refusal = "refused" if holds == "another secret" else \
        "holds the deployment secret but did not prove the front end's key"
    stranger.stop()
    assert any("control connection from" in line and refusal in line
               for w in deployment.workers for line in w.log().splitlines())
    assert deployment.front.metric("kvfence_ready") == 1.0


def test_status_lists_every_worker_with_its_pool_and_health(deployment: Deployment) -> None:
    over_etcd(deployment)
    until(lambda: all(deployment.paired(w) for w in deployment.workers[1:]), 60, "both decode workers paired")
    rows = status(deployment)
    assert sorted(rows) == sorted(f"{w.role}@{w.control}" for w in deployment.workers)
    for w in deployment.workers:
        row = rows[f"{w.role}@{w.control}"]
        total = 256 if w.role == "prefill" else 512
        assert row["health"] == "serving" and row["device"] == "cpu" and len(row["incarnation"]) == 32, row
        assert row["pages"]["total"] == total and row["pages"]["in_use"] == 0 and row["pages"]["quarantined"] == 0
        assert row["pages"]["free"] + row["pages"]["cached"] == total


def test_a_worker_with_an_incompatible_pool_is_refused_at_pairing(deployment: Deployment, reference: dict) -> None:
    """A bfloat16 decode worker joins: its pair with the float32 prefill worker is refused as a
    whole (the pools disagree on the bytes), it stays unpaired, and the others serve on."""
    over_etcd(deployment)
    odd = deployment.add_worker("decode", "--dtype", "bfloat16")
    odd.wait_ready()
    until(lambda: re.search(rf"decode worker at {re.escape(odd.control)} is refused as a whole: .*dtype",
                            deployment.front.log()) is not None, 60, "the bfloat16 pool refused at pairing")
    assert status(deployment)[f"decode@{odd.control}"]["health"] == "unpaired"
    all_served(deployment.front, reference, 2)
    assert odd.stop() == 0  # leaves before the faults below, which count on the float32 workers
    deployment.workers.remove(odd)


def test_kill_9_of_a_decode_worker_mid_stream(deployment: Deployment, reference: dict) -> None:
    over_etcd(deployment)
    until(lambda: all(deployment.paired(w) for w in deployment.workers[1:]), 60, "both decode workers paired")
    victim, running = signalled_mid_stream(deployment, reference, signal.SIGKILL)
    lost = [s for s in running if s.error is not None]
    assert lost, "no stream was on the killed worker"
    for s in lost:
        assert isinstance(s.error, openai.APIError) and "worker" in str(s.error) and "lost" in str(s.error), s.error
    for s in running:
        assert s.text.startswith(s.case["text_until_eos"]) or s.case["text_until_eos"].startswith(s.text), s.case["id"]
    assert f"decode@{victim.control} was lost" in deployment.front.log()
    at_baseline(deployment.front)
    assert not any(victim.control in name for name in deployment.front.pages_in_use())  # its series left /metrics
    assert deployment.front.metric("kvfence_ready") == 1.0
    all_served(deployment.front, reference, 4)  # the surviving decode worker serves everything
    at_baseline(deployment.front)
    until(lambda: f"decode@{victim.control}" not in status(deployment), 20, "the killed worker's lease expired")


def test_a_decode_worker_that_joins_while_serving_is_paired(deployment: Deployment, reference: dict) -> None:
    over_etcd(deployment)
    load = streams(deployment.front, reference, 3, STREAM_TOKENS)
    joined = deployment.add_worker("decode")
    joined.wait_ready()
    until(lambda: deployment.paired(joined), 60, "the joining decode worker paired")
    for s in load:
        s.join(180)
        assert s.error is None, s.error
    all_served(deployment.front, reference, 6)
    at_baseline(deployment.front)


def test_etcd_restarted_under_load(deployment: Deployment, reference: dict) -> None:
    over_etcd(deployment)
    load = streams(deployment.front, reference, 4, STREAM_TOKENS)
    deployment.etcd.stop()
    all_served(deployment.front, reference, 2)  # the data path never needs etcd
    deployment.etcd.start()
    for s in load:
        s.join(180)
        assert s.error is None, s.error
    live = {w.control for w in deployment.workers if w.proc.poll() is None}
    until(lambda: deployment.etcd.registered_controls() == live, 30, "every live worker registered again")
    late = deployment.add_worker("decode")  # membership is followed again after the restart
    late.wait_ready()
    until(lambda: deployment.paired(late), 60, "a worker joining after the restart paired")
    all_served(deployment.front, reference, 4)
    at_baseline(deployment.front)


def test_sigterm_drains_a_decode_worker(deployment: Deployment, reference: dict) -> None:
    """Its streams finish, nothing new goes to it, it exits 0 and leaves etcd; the others serve."""
    over_etcd(deployment)
    leaving, running = signalled_mid_stream(deployment, reference, signal.SIGTERM)
    for s in running:
        assert s.error is None and s.text.startswith(s.case["text_until_eos"]), (s.error, s.case["id"])
    assert leaving.proc.wait(60) == 0, leaving.log()
    assert "draining" in leaving.log()
    assert f"decode@{leaving.control} is draining" in deployment.front.log()
    until(lambda: leaving.control not in (deployment.etcd.registered_controls() or {leaving.control}), 15,
          "its registration revoked")
    all_served(deployment.front, reference, 4)
    at_baseline(deployment.front)
