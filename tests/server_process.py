"""Run `kvfence serve` as a real subprocess on a free port, for end-to-end tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import httpx

from ports import free_port


class Subprocess:
    """A kvfence process whose output goes to `log_path`."""

    proc: subprocess.Popen
    log_path: Path
    _log: TextIO

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def stop(self, timeout_s: float = 60) -> int:
        """SIGTERM, then SIGKILL after `timeout_s`; its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


class ServerProcess(Subprocess):
    def __init__(self, model: Path, *args: str, log_path: Path) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.admin_key: str | None = None  # set by a test that serves with --api-keys
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvfence.app.cli", "serve", "--model", str(model), "--port", str(self.port), *args],
            stdout=self._log, stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1", KVFENCE_KV_SANITIZER="true"))  # sanitizer on in tests

    def wait_ready(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.base_url + "/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout_s} s:\n{self.log()}")

    def metric(self, name: str, **labels: str) -> float:
        """One sample of a Prometheus metric from /metrics (with `admin_key` when the server has keys)."""
        headers = {"authorization": f"Bearer {self.admin_key}"} if self.admin_key else None
        text = httpx.get(self.base_url + "/metrics", headers=headers, timeout=5).text
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})? (\S+)$", line)
            if m and m.group(1) == name and ",".join(sorted((m.group(2) or "").split(","))) == want:
                return float(m.group(3))
        raise KeyError(f"{name}{{{want}}} not in /metrics")

    def pages_in_use(self) -> dict[str, float]:
        """Pages in use per pool, by the worker's name ("prefill", "decode", "colocated" in one
        process; role@address for workers in other processes)."""
        headers = {"authorization": f"Bearer {self.admin_key}"} if self.admin_key else None
        text = httpx.get(self.base_url + "/metrics", headers=headers, timeout=5).text
        found = re.findall(r'^kvfence_kv_pages\{state="in_use",worker="([^"]+)"\} (\S+)$', text, re.M)
        if not found:
            raise KeyError(f"no kvfence_kv_pages in_use series in /metrics:\n{text}")
        return {role: float(value) for role, value in found}


def serving(srv: ServerProcess) -> Iterator[ServerProcess]:
    """The body of a module fixture: `yield from serving(ServerProcess(...))` waits until it is
    ready, hands it to the tests, then stops it and checks it exited cleanly (0)."""
    try:
        srv.wait_ready()
        yield srv
    finally:
        code = srv.stop()
        assert code == 0, srv.log()


class WorkerProcess(Subprocess):
    """`kvfence worker` as a real subprocess, its control port on loopback (or `host`)."""

    def __init__(self, model: Path, role: str, *args: str, log_path: Path, host: str = "127.0.0.1",
                 prefix: tuple[str, ...] = ()) -> None:
        """`prefix`: run it under this command (e.g. `ip netns exec NAME`)."""
        self.role = role
        self.port = free_port()
        self.control = f"{host}:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "kvfence.app.cli", "worker", "--role", role, "--control", self.control,
             "--model", str(model), *args],
            stdout=self._log, stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1", KVFENCE_KV_SANITIZER="true"))

    def wait_ready(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.role} worker exited with {self.proc.returncode}:\n{self.log()}")
            if "ready for its scheduler" in self.log():
                return
            time.sleep(0.2)
        raise TimeoutError(f"{self.role} worker not ready after {timeout_s} s:\n{self.log()}")



def front_key_files(directory: Path, name: str = "front") -> tuple[Path, Path]:
    """A fresh front end key pair, as `kvfence front-key` writes it: (private, readable only by its
    owner; public)."""
    from kvfence.transports.core.front_key import FrontKey

    private, public = directory / f"{name}.key", directory / f"{name}.pub"
    FrontKey.generate().write(private, public)
    return private, public


def secret_file(directory: Path) -> Path:
    """A fresh deployment secret, readable only by its owner."""
    path = directory / "deployment.secret"
    path.write_text(os.urandom(32).hex())
    path.chmod(0o600)
    return path
