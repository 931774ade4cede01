"""A real etcd (Debian's etcd-server) for tests: its own free ports and data directory, started and
stopped by the test."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import anyio
import httpx
import pytest

from kvfence.app.remote.membership import ETCD_ERRORS, registered_workers

from ports import free_port

ETCD = shutil.which("etcd")


def need_etcd() -> None:
    if ETCD is None:
        pytest.skip("etcd is not installed (scripts/setup.sh installs Debian's etcd-server)")


class EtcdServer:
    def __init__(self, directory: Path, hosts: tuple[str, ...] = ()) -> None:
        """Listening on loopback and on `hosts` (addresses of this namespace other hosts reach)."""
        need_etcd()
        self.directory = directory
        self.hosts = hosts
        self.port, self.peer_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        """Start (again, on the same ports and data) and wait until it answers."""
        url, peer = f"http://{self.address}", f"http://127.0.0.1:{self.peer_port}"
        listen = ",".join([url, *(f"http://{h}:{self.port}" for h in self.hosts)])
        self._log = open(self.directory / "etcd.log", "a")
        self.proc = subprocess.Popen(
            [ETCD, "--data-dir", str(self.directory / "data"), "--listen-client-urls", listen,
             "--advertise-client-urls", url, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"default={peer}"], stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).json().get("health") == "true":
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"etcd not healthy after 30 s:\n{(self.directory / 'etcd.log').read_text()}")

    def registered_controls(self) -> set[str] | None:
        """The control addresses of the workers registered now (None while etcd does not answer)."""
        async def listed() -> set[str]:
            return {r.control for r in await registered_workers("127.0.0.1", self.port, None)}

        try:
            return anyio.run(listed)
        except ETCD_ERRORS:
            return None

    def stop(self) -> None:
        """Stop it (SIGTERM, then SIGKILL after 10 s); no etcd outlives its test."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
