"""Workers on two hosts and a front end here, for the end-to-end tests across hosts: the
`Deployment` (tests/netns.py's two namespaces, `kvfence worker` on each, `kvfence serve` here, a
real etcd over tcp) and what the tests do with it (streams, faults mid-stream, baselines)."""

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
from server_process import ServerProcess, WorkerProcess, front_key_files, secret_file

MODEL = "SmolLM2-135M-Instruct"
POOLS = ("--max-context", "2048", "--prefill-num-pages", "256", "--decode-num-pages", "512")
STREAM_TOKENS = 96  # long enough to be mid-stream when a fault strikes
WORKER_TIMEOUT_S = 2  # under etcd's lease TTL, so the keep-alive, not membership, notices a silent worker


class Deployment:
    """Workers on two hosts and a front end here. Over tcp: a prefill and two decode workers that
    find the front end through a real etcd; over the others: one of each, listed statically."""

    def __init__(self, model: Path, transport: str, directory: Path, hosts: TwoHosts) -> None:
        self.model, self.transport, self.directory, self.hosts = model, transport, directory, hosts
        self.secret = secret_file(directory)
        self.front_key, self.front_public = front_key_files(directory)
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
        consent = (f"--{self.transport}-unauthenticated-ports-ok",) if self.transport in ("nixl", "mooncake") else ()
        w = WorkerProcess(self.model, role, "--transport", self.transport, *consent, "--transport-secret-file",
                          str(self.secret), "--front-public-key-file", str(self.front_public), "--transport-host",
                          self.hosts.kv[role], *POOLS, *registering, *extra,
                          log_path=self.directory / f"{role}{len(self.workers)}.log", host=self.hosts.host(role),
                          prefix=self.hosts.prefix(role))
        self.workers.append(w)
        return w

    def start_front(self, *extra: str) -> ServerProcess:
        self.fronts += 1
        discovery = f"etcd://{self.etcd.address}" if self.etcd else "static://" + ",".join(w.control
                                                                                          for w in self.workers)
        front = ServerProcess(self.model, "--discovery", discovery, "--transport-secret-file", str(self.secret),
                              "--front-key-file", str(self.front_key), "--canary-interval", "3600", "--chunk-tokens",
                              "256", "--worker-timeout", str(WORKER_TIMEOUT_S), *extra,
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


def deployed(transport: str, model: Path, directory: Path) -> Iterator[Deployment]:
    """A ready deployment over `transport` in two fresh namespaces, all of it stopped after."""
    hosts = TwoHosts()
    try:
        d = Deployment(model, transport, directory, hosts)
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
                           f"etcd://{deployment.etcd.address}", "--front", deployment.front.base_url, "--json",
                           "--transport-secret-file", str(deployment.secret)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return {row["name"]: row for row in json.loads(done.stdout)}
