"""Prefill and decode workers each in their own process (`kvfence worker`), driven by a front end
in a third (`kvfence serve --discovery etcd://...` over tcp, where the workers register in a real
etcd; `static://...` over the others): the KV crosses between two processes over tcp, nixl and
mooncake, and answers equal the greedy references through the official openai
client. Stopping the front end ends its leases on both workers; a new front end serves exactly
again. A front end without the deployment secret gets nothing from the workers."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from etcd_server import EtcdServer
from server_process import ServerProcess, WorkerProcess, secret_file

MODEL = "SmolLM2-135M-Instruct"
POOLS = ("--max-context", "2048", "--prefill-num-pages", "256", "--decode-num-pages", "512")


class Deployment:
    """Two workers and a front end; over tcp they find each other through a real etcd, over the
    others through a static list."""

    def __init__(self, model: Path, transport: str, directory: Path) -> None:
        self.model, self.transport, self.directory = model, transport, directory
        self.secret = secret_file(directory)
        self.etcd = EtcdServer(directory) if transport == "tcp" else None
        registering = ("--discovery", f"etcd://{self.etcd.address}") if self.etcd else ()
        common = ("--transport", transport, "--transport-secret-file", str(self.secret), *POOLS, *registering)
        self.workers = [WorkerProcess(model, role, *common, log_path=directory / f"{role}.log")
                        for role in ("prefill", "decode")]
        for w in self.workers:
            w.wait_ready()
        self.fronts = 0
        self.front = self.start_front()

    def start_front(self, *extra: str) -> ServerProcess:
        self.fronts += 1
        discovery = f"etcd://{self.etcd.address}" if self.etcd else "static://" + ",".join(w.control
                                                                                          for w in self.workers)
        front = ServerProcess(self.model, "--discovery", discovery, "--transport-secret-file", str(self.secret),
                              "--canary-interval", "3600", "--chunk-tokens", "256", *extra,
                              log_path=self.directory / f"front{self.fronts}.log")
        return front

    def stop(self) -> None:
        codes = {"front": self.front.stop(), **{w.role: w.stop() for w in self.workers}}
        if self.etcd is not None:
            self.etcd.stop()
        assert all(c == 0 for c in codes.values()), (codes, self.front.log(), *(w.log() for w in self.workers))


@pytest.fixture(scope="module", params=["tcp", "nixl", "mooncake"])
def deployment(request: pytest.FixtureRequest, default_model_path: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    d = Deployment(default_model_path, request.param, tmp_path_factory.mktemp(f"remote-{request.param}"))
    try:
        d.front.wait_ready()
        yield d
    finally:
        d.stop()


def greedy() -> dict:
    return {"model": MODEL, "max_tokens": 32, "temperature": 0, "extra_body": {"ignore_eos": True}}


def chat_references_hold(front: ServerProcess, reference: dict) -> None:
    with openai.OpenAI(base_url=front.base_url + "/v1", api_key="unused", max_retries=0) as client:
        for case in [c for c in reference["cases"] if c["kind"] == "chat"]:
            r = client.chat.completions.create(messages=case["messages"], **greedy())
            assert r.choices[0].message.content.startswith(case["text_until_eos"]), case["id"]
            assert r.usage.prompt_tokens == case["num_prompt_tokens"] and r.usage.completion_tokens == 32
        for case in [c for c in reference["cases"] if c["kind"] == "completion"]:
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
        assert "etcd at" in log and "lists 2 workers" in log, log
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
    chat_references_hold(deployment.front, reference)
    wait_baseline(deployment.front)


def test_a_front_end_without_the_secret_gets_nothing(deployment: Deployment, tmp_path: Path) -> None:
    """While one front end owns the workers, a second with the wrong deployment secret fails the
    handshake, says so and exits 1; the workers log the refusal and keep serving the first."""
    if deployment.transport != "tcp":
        pytest.skip("the control connection's handshake does not depend on the KV transport: checked over tcp")
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
