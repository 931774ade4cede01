"""A kvfence server of the scripts' own: started on a free port, waited for until ready, stopped;
and what several scripts read from it (error codes, percentiles)."""

from __future__ import annotations

import hashlib
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

MODEL = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_keys(path: Path, tenants: list[str], admin: bool = False) -> dict[str, str]:
    """A keys file (app/api/keys.py) of fresh keys for `tenants` (and an admin, under "admin"):
    their digests into `path`, the keys returned by name."""
    names = tenants + (["admin"] if admin else [])
    keys = {name: f"kvf-{secrets.token_hex(16)}" for name in names}
    path.write_text("".join(f'[{"admin" if name == "admin" and admin else "tenants." + name}]\n'
                            f'key_sha256 = ["{hashlib.sha256(key.encode()).hexdigest()}"]\n\n'
                            for name, key in keys.items()))
    return keys


def start(flags: list[str], log: Path, timeout_s: float = 300) -> tuple[subprocess.Popen, str]:
    """`kvfence serve --port P *flags` (its output into `log`) once `/ready` is 200: (process, URL)."""
    port = free_port()
    proc = subprocess.Popen([str(Path(sys.executable).with_name("kvfence")), "serve", "--port", str(port), *flags],
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, url, log, timeout_s)
    return proc, url


def wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout_s: float = 300) -> None:
    """Return once the server `proc` serves `url` and its `/ready` is 200; SystemExit (killing it
    when it is still running) when it exits or is not ready in `timeout_s`, naming its `log`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the server was not ready in {timeout_s:g} s; see {log}")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def error_code(response: httpx.Response) -> str | None:
    try:
        return response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0
