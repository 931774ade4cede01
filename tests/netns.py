"""Two hosts on this machine for tests: network namespaces made and removed by the test (as root).

A prefill host and a decode host, joined by a veth pair that carries the KV (each worker's KV
endpoint listens on its end of it), and each joined to this namespace by a veth pair of its own,
which carries the control connections and etcd (the front end and etcd run here). Traffic only
ever goes to these namespaces' own addresses. Where namespaces cannot be made (not root, no `ip`,
no permission) `TwoHosts()` skips the test with the reason.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess

import pytest

IP = shutil.which("ip")


def _ip(*args: str) -> None:
    assert IP is not None
    done = subprocess.run([IP, *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class TwoHosts:
    def __init__(self) -> None:
        if IP is None:
            pytest.skip("network namespaces need iproute2's `ip` (scripts/setup.sh installs it)")
        if os.geteuid() != 0:
            pytest.skip("network namespaces need root")
        tag, k = os.urandom(3).hex(), random.randrange(1, 250)
        self.tag = tag
        self.namespaces = {"prefill": f"kvfence-p-{tag}", "decode": f"kvfence-d-{tag}"}
        # role -> (this namespace's address, the host's address) on their control link
        self.control = {"prefill": (f"10.211.{k}.1", f"10.211.{k}.2"), "decode": (f"10.212.{k}.1", f"10.212.{k}.2")}
        self.kv = {"prefill": f"10.213.{k}.1", "decode": f"10.213.{k}.2"}  # the hosts' ends of the KV link
        try:
            self._build(tag)
        except OSError as e:
            self.remove()
            pytest.skip(f"cannot make network namespaces here: {e}")

    def _build(self, tag: str) -> None:
        for role, ns in self.namespaces.items():
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            here, there = f"kvh{role[0]}{tag}", f"kvn{role[0]}{tag}"
            _ip("link", "add", here, "type", "veth", "peer", "name", there)
            _ip("link", "set", there, "netns", ns)
            mine, theirs = self.control[role]
            _ip("addr", "add", f"{mine}/24", "dev", here)
            _ip("link", "set", here, "up")
            _ip("-n", ns, "addr", "add", f"{theirs}/24", "dev", there)
            _ip("-n", ns, "link", "set", there, "up")
        p, d = f"kvkp{tag}", f"kvkd{tag}"
        _ip("link", "add", p, "type", "veth", "peer", "name", d)
        for role, link in (("prefill", p), ("decode", d)):
            ns = self.namespaces[role]
            _ip("link", "set", link, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{self.kv[role]}/24", "dev", link)
            _ip("-n", ns, "link", "set", link, "up")

    def prefix(self, role: str) -> tuple[str, ...]:
        """The command prefix that runs a process on `role`'s host."""
        assert IP is not None
        return (IP, "netns", "exec", self.namespaces[role])

    def host(self, role: str) -> str:
        """`role`'s host's address as this namespace reaches it (its control address)."""
        return self.control[role][1]

    def here(self, role: str) -> str:
        """This namespace's address as `role`'s host reaches it (for etcd)."""
        return self.control[role][0]

    def control_link(self, role: str, up: bool) -> None:
        """Take `role`'s host's control link down (a silent partition: no reset, no FIN, from
        either side) or bring it back up."""
        _ip("-n", self.namespaces[role], "link", "set", f"kvn{role[0]}{self.tag}", "up" if up else "down")

    def remove(self) -> None:
        """Delete both namespaces (their veth pairs go with them)."""
        for ns in self.namespaces.values():
            subprocess.run([IP or "ip", "netns", "del", ns], capture_output=True)
