"""Back-pressure and shutdown of the real server: a full queue is 503 with Retry-After; SIGTERM
drains in-flight requests, refuses new ones, and exits 0."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx
from server_process import ServerProcess

MODEL = "SmolLM2-135M-Instruct"


def long_request(base_url: str, results: list, max_tokens: int = 48) -> None:
    r = httpx.post(base_url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    results.append(r)


def test_queue_full_then_sigterm_drains(default_model_path: Path, tmp_path: Path) -> None:
    srv = ServerProcess(default_model_path, "--canary-interval", "3600", "--max-context", "512", "--max-running", "1",
                        "--max-queue", "1", "--prefill-num-pages", "64", "--decode-num-pages", "64",
                        "--shutdown-timeout", "60",
                        log_path=tmp_path / "server.log")
    try:
        srv.wait_ready()
        results: list[httpx.Response] = []
        threads = [threading.Thread(target=long_request, args=(srv.base_url, results)) for _ in range(2)]
        for t in threads:
            t.start()
            time.sleep(0.3)  # the first runs, the second waits in the queue
        third = httpx.post(srv.base_url + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": "hi", "max_tokens": 4})
        assert third.status_code == 503, third.text
        assert int(third.headers["retry-after"]) >= 1
        assert third.json()["error"]["code"] == "overloaded"

        srv.proc.send_signal(signal.SIGTERM)  # both admitted requests must still finish
        time.sleep(0.3)
        assert httpx.get(srv.base_url + "/ready", timeout=5).status_code == 503
        refused = httpx.post(srv.base_url + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": "hi", "max_tokens": 4})
        assert refused.status_code == 503
        for t in threads:
            t.join(120)
        assert [r.status_code for r in results] == [200, 200]
        for r in results:
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 48
        assert results[0].json()["choices"][0]["text"] == results[1].json()["choices"][0]["text"]
        assert srv.proc.wait(60) == 0
    finally:
        srv.stop()


def test_undersized_pool_refuses_to_start(default_model_path: Path, tmp_path: Path) -> None:
    srv = ServerProcess(default_model_path, "--prefill-num-pages", "8", log_path=tmp_path / "server.log")
    assert srv.proc.wait(60) == 2
    log = srv.log()
    assert "prefill KV pool holds 128 tokens" in log and "8192" in log and "--clamp-context" in log
    srv.stop()


def test_clamped_context_is_advertised(default_model_path: Path, tmp_path: Path) -> None:
    srv = ServerProcess(default_model_path, "--canary-interval", "3600", "--prefill-num-pages", "32",
                        "--decode-num-pages", "64", "--clamp-context", log_path=tmp_path / "server.log")
    try:
        srv.wait_ready()
        models = httpx.get(srv.base_url + "/v1/models", timeout=10).json()
        assert models["data"][0]["max_model_len"] == 512  # what the smaller (prefill) pool holds
        r = httpx.post(srv.base_url + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": "hi " * 600, "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    finally:
        assert srv.stop() == 0


def test_corrupted_transfer_is_a_5xx_never_a_200(default_model_path: Path, tmp_path: Path) -> None:
    """One byte flipped in transit (the readiness canary is push 1, this request push 2): the client
    gets 502 kv_transfer_failed with no content; the next request is served; pages return."""
    srv = ServerProcess(default_model_path, "--canary-interval", "3600", "--max-context", "512",
                        "--prefill-num-pages", "64", "--decode-num-pages", "64", "--fault-inject", "corrupt#2",
                        log_path=tmp_path / "server.log")
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    try:
        srv.wait_ready()
        bad = httpx.post(srv.base_url + "/v1/completions", timeout=60, json=body)
        assert bad.status_code == 502, bad.text
        assert bad.json()["error"]["code"] == "kv_transfer_failed" and "choices" not in bad.json()
        good = httpx.post(srv.base_url + "/v1/completions", timeout=60, json=body)
        assert good.status_code == 200 and good.json()["choices"][0]["text"].startswith(" Paris")
        assert srv.metric("kvfence_kv_transfers_total", result="failed") == 1
        assert srv.pages_in_use() == {"prefill": 0, "decode": 0}
    finally:
        assert srv.stop() == 0
