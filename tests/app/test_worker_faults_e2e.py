"""Worker faults across processes: a prefill worker and two decode workers, each its own `kvfence
worker` process registered in a real etcd, and a front end (`kvfence serve --discovery etcd://`)
that pairs the prefill worker with both. Through the official openai client on a real socket:

- `kill -9` of a decode worker mid-stream: its streams end with a 503 worker_lost error (none
  reports success), every other stream answers the reference, the front end stays ready, the
  survivors' pages return to baseline, and the surviving decode worker serves every request after;
- a decode worker that joins while serving is paired and serves;
- etcd restarted under load: serving goes on, and membership recovers (the workers register again
  and a worker that joins after it is found).
"""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from etcd_server import EtcdServer
from server_process import ServerProcess, WorkerProcess, secret_file

MODEL = "SmolLM2-135M-Instruct"
POOLS = ("--max-context", "2048", "--prefill-num-pages", "256", "--decode-num-pages", "512")


class Fleet:
    def __init__(self, model: Path, directory: Path) -> None:
        self.model, self.directory = model, directory
        self.secret = secret_file(directory)
        self.etcd = EtcdServer(directory)
        self.workers: list[WorkerProcess] = []
        for role in ("prefill", "decode", "decode"):
            self.add_worker(role)
        for w in self.workers:
            w.wait_ready()
        self.front = ServerProcess(model, "--discovery", f"etcd://{self.etcd.address}", "--transport-secret-file",
                                   str(self.secret), "--canary-interval", "3600", "--chunk-tokens", "256",
                                   log_path=directory / "front.log")

    def add_worker(self, role: str) -> WorkerProcess:
        w = WorkerProcess(self.model, role, "--transport", "tcp", "--transport-secret-file", str(self.secret),
                          "--discovery", f"etcd://{self.etcd.address}", *POOLS,
                          log_path=self.directory / f"{role}{len(self.workers)}.log")
        self.workers.append(w)
        return w

    def paired(self, decode: WorkerProcess) -> bool:
        return re.search(rf"-> the decode worker at {re.escape(decode.control)} over tcp", self.front.log()) is not None

    def stop(self) -> None:
        killed = [w for w in self.workers if w.proc.poll() is not None]
        codes = [self.front.stop(), *(w.stop() for w in self.workers if w not in killed)]
        for w in killed:
            w.stop()
        self.etcd.stop()
        assert all(c == 0 for c in codes), (codes, self.front.log())


@pytest.fixture(scope="module")
def fleet(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(default_model_path, tmp_path_factory.mktemp("faults"))
    try:
        f.front.wait_ready()
        yield f
    finally:
        f.stop()


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


def all_served(front: ServerProcess, reference: dict, n: int) -> None:
    for s in streams(front, reference, n, 24):
        s.join(120)
        assert s.error is None and s.text.startswith(s.case["text_until_eos"][:40]), (s.error, s.text)


def at_baseline(front: ServerProcess) -> None:
    until(lambda: not any(front.pages_in_use().values()), 15, f"pages back: {front.pages_in_use()}")


def test_kill_9_of_a_decode_worker_mid_stream(fleet: Fleet, reference: dict) -> None:
    until(lambda: all(fleet.paired(w) for w in fleet.workers[1:]), 60, "both decode workers paired")
    victim = fleet.workers[2]
    running = streams(fleet.front, reference, 6, 400)
    for s in running:
        assert s.started.wait(120)
    victim.proc.send_signal(signal.SIGKILL)
    for s in running:
        s.join(180)
    lost = [s for s in running if s.error is not None]
    assert lost, "no stream was on the killed worker"
    for s in lost:
        assert isinstance(s.error, openai.APIError) and "worker" in str(s.error) and "lost" in str(s.error), s.error
    for s in running:
        assert s.text.startswith(s.case["text_until_eos"]) or s.case["text_until_eos"].startswith(s.text), s.case["id"]
    assert f"decode@{victim.control} was lost" in fleet.front.log()
    at_baseline(fleet.front)
    assert not any(victim.control in name for name in fleet.front.pages_in_use())  # its series left /metrics
    assert fleet.front.metric("kvfence_ready") == 1.0
    all_served(fleet.front, reference, 4)  # the surviving decode worker serves everything
    at_baseline(fleet.front)


def test_a_decode_worker_that_joins_while_serving_is_paired(fleet: Fleet, reference: dict) -> None:
    load = streams(fleet.front, reference, 3, 200)
    joined = fleet.add_worker("decode")
    joined.wait_ready()
    until(lambda: fleet.paired(joined), 60, "the joining decode worker paired")
    for s in load:
        s.join(180)
        assert s.error is None, s.error
    all_served(fleet.front, reference, 6)
    at_baseline(fleet.front)


def test_etcd_restarted_under_load(fleet: Fleet, reference: dict) -> None:
    load = streams(fleet.front, reference, 4, 200)
    fleet.etcd.stop()
    all_served(fleet.front, reference, 2)  # the data path never needs etcd
    fleet.etcd.start()
    for s in load:
        s.join(180)
        assert s.error is None, s.error
    live = {w.control for w in fleet.workers if w.proc.poll() is None}
    until(lambda: fleet.etcd.registered_controls() == live, 30, "every live worker registered again")
    late = fleet.add_worker("decode")  # membership is followed again after the restart
    late.wait_ready()
    until(lambda: fleet.paired(late), 60, "a worker joining after the restart paired")
    all_served(fleet.front, reference, 4)
    at_baseline(fleet.front)
