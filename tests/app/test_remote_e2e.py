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

import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from etcd_server import EtcdServer
from netns import TwoHosts
from server_process import ServerProcess, WorkerProcess, secret_file

MODEL = "SmolLM2-135M-Instruct"
POOLS = ("--max-context", "2048", "--prefill-num-pages", "256", "--decode-num-pages", "512")
STREAM_TOKENS = 96  # long enough to be mid-stream when a fault strikes


class Deployment:
    """Workers on two hosts and a front end here. Over tcp: a prefill and two decode workers that
    find the front end through a real etcd; over the others: one of each, listed statically."""

    def __init__(self, model: Path, transport: str, directory: Path, hosts: TwoHosts) -> None:
        self.model, self.transport, self.directory, self.hosts = model, transport, directory, hosts
        self.secret = secret_file(directory)
        self.etcd = EtcdServer(directory, (hosts.here("prefill"), hosts.here("decode"))) \
            if transport == "tcp" else None
        self.workers: list[WorkerProcess] = []
        self.fronts = 0
        try:
            for role in ("prefill", "decode", "decode") if self.etcd else ("prefill", "decode"):
                self.add_worker(role)
            for w in self.workers:
                w.wait_ready()
            self.front = self.start_front()
        except BaseException:  # nothing it started outlives a failed set-up
            for w in self.workers:
                w.stop()
            if self.etcd is not None:
                self.etcd.stop()
            raise

    def add_worker(self, role: str, *extra: str) -> WorkerProcess:
        registering = ("--discovery", f"etcd://{self.hosts.here(role)}:{self.etcd.port}") if self.etcd else ()
        consent = ("--mooncake-unauthenticated-ports-ok",) if self.transport == "mooncake" else ()
        w = WorkerProcess(self.model, role, "--transport", self.transport, *consent, "--transport-secret-file",
                          str(self.secret), "--transport-host", self.hosts.kv[role], *POOLS, *registering, *extra,
                          log_path=self.directory / f"{role}{len(self.workers)}.log", host=self.hosts.host(role),
                          prefix=self.hosts.prefix(role))
        self.workers.append(w)
        return w

    def start_front(self, *extra: str) -> ServerProcess:
        self.fronts += 1
        discovery = f"etcd://{self.etcd.address}" if self.etcd else "static://" + ",".join(w.control
                                                                                          for w in self.workers)
        front = ServerProcess(self.model, "--discovery", discovery, "--transport-secret-file", str(self.secret),
                              "--canary-interval", "3600", "--chunk-tokens", "256", *extra,
                              log_path=self.directory / f"front{self.fronts}.log")
        return front

    def paired(self, decode: WorkerProcess) -> bool:
        return re.search(rf"-> the decode worker at {re.escape(decode.control)} over {self.transport}",
                         self.front.log()) is not None

    def stop(self) -> None:
        killed = [w for w in self.workers if w.proc.poll() is not None]
        try:
            codes = [self.front.stop(), *(w.stop() for w in self.workers if w not in killed)]
            for w in killed:
                w.stop()
        finally:
            if self.etcd is not None:
                self.etcd.stop()
        assert all(c == 0 for c in codes), (codes, self.front.log(), *(w.log() for w in self.workers))


@pytest.fixture(scope="module", params=["tcp", "nixl", "mooncake"])
def deployment(request: pytest.FixtureRequest, default_model_path: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    hosts = TwoHosts()
    try:
        d = Deployment(default_model_path, request.param, tmp_path_factory.mktemp(f"remote-{request.param}"), hosts)
        try:
            d.front.wait_ready()
            yield d
        finally:
            d.stop()
    finally:
        hosts.remove()


def over_etcd(deployment: Deployment) -> None:
    if deployment.etcd is None:
        pytest.skip("membership and worker faults do not depend on the KV transport: checked over tcp")


def greedy() -> dict:
    return {"model": MODEL, "max_tokens": 32, "temperature": 0, "extra_body": {"ignore_eos": True}}


def chat_references_hold(front: ServerProcess, reference: dict, per_kind: int | None = None) -> None:
    """The references (the first `per_kind` of each kind, or all), chat non-streamed and
    completions streamed, through the official client."""
    with openai.OpenAI(base_url=front.base_url + "/v1", api_key="unused", max_retries=0) as client:
        for case in [c for c in reference["cases"] if c["kind"] == "chat"][:per_kind]:
            r = client.chat.completions.create(messages=case["messages"], **greedy())
            assert r.choices[0].message.content.startswith(case["text_until_eos"]), case["id"]
            assert r.usage.prompt_tokens == case["num_prompt_tokens"] and r.usage.completion_tokens == 32
        for case in [c for c in reference["cases"] if c["kind"] == "completion"][:per_kind]:
            stream = client.completions.create(prompt=case["prompt"], stream=True, **greedy())
            text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
            assert text.startswith(case["text_until_eos"]), case["id"]


def wait_baseline(front: ServerProcess) -> None:
    deadline = time.monotonic() + 10
    while any(front.pages_in_use().values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(front.pages_in_use().values()), front.pages_in_use()


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


def test_a_front_end_without_the_secret_gets_nothing(deployment: Deployment, tmp_path: Path) -> None:
    """While one front end owns the workers, a second with the wrong deployment secret fails the
    handshake, says so and exits 1; the workers log the refusal and keep serving the first."""
    over_etcd(deployment)
    other = secret_file(tmp_path)
    discovery = "static://" + ",".join(w.control for w in deployment.workers)
    stranger = ServerProcess(deployment.model, "--discovery", discovery, "--transport-secret-file", str(other),
                             log_path=tmp_path / "stranger.log")
    assert stranger.proc.wait(120) == 1
    assert "did not prove the deployment secret" in stranger.log(), stranger.log()
    stranger.stop()
    assert any("control connection from" in line and "refused" in line
               for w in deployment.workers for line in w.log().splitlines())
    assert deployment.front.metric("kvfence_ready") == 1.0


def until(condition, timeout_s: float = 30, what: str = "") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.1)


def client(front: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=front.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat_case(reference: dict, i: int) -> dict:
    chats = [c for c in reference["cases"] if c["kind"] == "chat"]
    return chats[i % len(chats)]


class Stream(threading.Thread):
    """One streamed greedy chat completion; `text`, and `error` (the openai error) when it failed."""

    def __init__(self, front: ServerProcess, case: dict, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.front, self.case, self.max_tokens = front, case, max_tokens
        self.text, self.error = "", None  # type: str, openai.APIError | None
        self.started = threading.Event()

    def run(self) -> None:
        try:
            with client(self.front) as c:
                stream = c.chat.completions.create(model=MODEL, messages=self.case["messages"], stream=True,
                                                   max_tokens=self.max_tokens, temperature=0,
                                                   extra_body={"ignore_eos": True})
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        self.text += chunk.choices[0].delta.content
                        self.started.set()
        except openai.APIError as e:
            self.error = e
        finally:
            self.started.set()


def streams(front: ServerProcess, reference: dict, n: int, max_tokens: int) -> list[Stream]:
    out = [Stream(front, chat_case(reference, i), max_tokens) for i in range(n)]
    for s in out:
        s.start()
    return out


def signalled_mid_stream(deployment: Deployment, reference: dict,
                         signum: signal.Signals) -> tuple[WorkerProcess, list[Stream]]:
    """Six streams; once each has its first token, `signum` goes to the live decode worker holding
    the most of their pages (the router spreads by load and cache affinity, so which one that is
    is the router's choice). The worker, and the streams, ended."""
    running = streams(deployment.front, reference, 6, STREAM_TOKENS)
    for s in running:
        assert s.started.wait(120)
    in_use = deployment.front.pages_in_use()
    live = [w for w in deployment.workers if w.role == "decode" and w.proc.poll() is None]
    worker = max(live, key=lambda w: in_use.get(f"decode@{w.control}", 0.0))
    assert in_use.get(f"decode@{worker.control}", 0.0) > 0, in_use
    worker.proc.send_signal(signum)
    for s in running:
        s.join(180)
    return worker, running


def all_served(front: ServerProcess, reference: dict, n: int) -> None:
    for s in streams(front, reference, n, 24):
        s.join(120)
        assert s.error is None and s.text.startswith(s.case["text_until_eos"][:40]), (s.error, s.text)


def at_baseline(front: ServerProcess) -> None:
    until(lambda: not any(front.pages_in_use().values()), 15, f"pages back: {front.pages_in_use()}")


def status(deployment: Deployment) -> dict[str, dict]:
    done = subprocess.run([sys.executable, "-m", "kvfence.app.cli", "status", "--discovery",
                           f"etcd://{deployment.etcd.address}", "--front", deployment.front.base_url, "--json"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return {row["name"]: row for row in json.loads(done.stdout)}


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
