"""`kvfence probe` against real kvfence servers on real sockets (tiny model, two tenants' keys):
every check passes against a server with its guards, and the probe reports the leak, with exit
status 1, against a server whose prefix cache deliberately ignores the tenant."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_process import ServerProcess, serving

from kvfence.app.api.keys import key_digest

MODEL = "tiny-probe"
KEY_A, KEY_B, ADMIN = "probe-a-key", "probe-b-key", "probe-admin"


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from tiny_models import TinySpec, make_tiny_pair

    gguf, hf_dir, _ = make_tiny_pair(tmp_path_factory.mktemp("tiny"), seed=3, spec=TinySpec(context_length=8192))
    return gguf, hf_dir


@pytest.fixture(scope="module")
def tiny_gguf(tiny_pair: tuple[Path, Path]) -> Path:
    return tiny_pair[0]


def start(tmp_path_factory: pytest.TempPathFactory, gguf: Path, *extra: str) -> Iterator[ServerProcess]:
    keys = tmp_path_factory.mktemp("keys") / "keys.toml"
    keys.write_text(f'[tenants.a]\nkey_sha256 = ["{key_digest(KEY_A)}"]\n[tenants.b]\nkey_sha256 = '
                    f'["{key_digest(KEY_B)}"]\n[admin]\nkey_sha256 = ["{key_digest(ADMIN)}"]\n')
    srv = ServerProcess(gguf, "--served-model-name", MODEL, "--canary-interval", "3600", "--api-keys", str(keys),
                        "--max-context", "1024", *extra, log_path=tmp_path_factory.mktemp("server") / "server.log")
    srv.admin_key = ADMIN
    yield from serving(srv)


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path) -> Iterator[ServerProcess]:
    yield from start(tmp_path_factory, tiny_gguf)


@pytest.fixture(scope="module")
def broken(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path) -> Iterator[ServerProcess]:
    yield from start(tmp_path_factory, tiny_gguf, "--unsafe-cache-across-tenants")


def probe(srv: ServerProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvfence.app.cli", "probe", srv.base_url, "--key", KEY_A,
                           "--other-key", KEY_B, *args], capture_output=True, text=True, timeout=600)


def test_no_two_timing_prompts_share_a_first_page(tiny_pair: tuple[Path, Path]) -> None:
    """B's cache hits on A's prompt are counted as leaks, so none may come from B's own earlier
    prompts: the first cache page (16 tokens) of every timing prompt, as the tiny model's chat
    template and byte-level tokenizer make it (fewer characters per token than real ones), is
    unique. Prompts of plain words from the probe's list do share first pages by chance."""
    from kvfence.app.tools.probe import Prober
    from kvfence.engine.chat_template import render_chat
    from kvfence.engine.tokenizer import tokenizer_from_hf_dir

    hf_dir = tiny_pair[1]
    tok = tokenizer_from_hf_dir(hf_dir)
    template = json.loads((hf_dir / "tokenizer_config.json").read_text())["chat_template"]
    prober = Prober("http://127.0.0.1:1", None, None, MODEL, seed=0)
    try:
        pages = [tuple(tok.encode(render_chat(template, prober.fresh_prompt(64), add_generation_prompt=True))[:16])
                 for _ in range(300)]
    finally:
        prober.close()
    assert len(set(pages)) == len(pages)


def test_every_check_passes_against_kvfence(guarded: ServerProcess) -> None:
    done = probe(guarded, "--json", "--no-progress")
    assert done.returncode == 0, done.stdout + done.stderr
    rep = json.loads(done.stdout)
    statuses = {c["name"]: c["status"] for c in rep["checks"]}
    assert rep["ok"] and set(statuses.values()) == {"pass"}, statuses
    assert {"canaries: plain", "canaries: near the context", "canaries: cancelled mid-stream", "canaries: concurrent",
            "over-long prompt refused", "transfer fields refused", "prefix cache across keys",
            "error envelope"} == set(statuses)
    timing = next(c for c in rep["checks"] if c["name"] == "prefix cache across keys")
    assert timing["data"]["b_cached_tokens"] == [0, 0, 0, 0]


def test_the_probe_reports_the_leak_of_a_broken_guard(broken: ServerProcess) -> None:
    done = probe(broken)  # the table, with its progress bar on stderr
    assert done.returncode == 1, done.stdout + done.stderr
    row = next(line for line in done.stdout.splitlines() if line.startswith("prefix cache across keys"))
    assert "LEAK" in row and "cached" in row, done.stdout
    assert "probing" in done.stderr  # the progress bar
    assert "UNSAFE" in broken.log()


def test_a_server_that_is_not_there_is_exit_2(tmp_path: Path) -> None:
    from ports import free_port

    done = subprocess.run([sys.executable, "-m", "kvfence.app.cli", "probe", f"http://127.0.0.1:{free_port()}",
                           "--no-progress"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "cannot probe" in done.stderr
