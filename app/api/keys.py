"""API keys and the tenants they authenticate (`--api-keys FILE`).

The file is TOML; each tenant is a table under `tenants`, with its keys stored as SHA-256 digests
(never the key itself) and its limits:

    [tenants.acme]
    key_sha256 = ["9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"]
    max_running = 8           # requests holding KV pages at once
    max_queued = 32           # requests waiting for pages
    tokens_per_minute = 200000   # charged prompt + max_tokens at admission, settled at the end
    weight = 2                # its share of running slots and decode pages against others' (default 1)

    [admin]                   # /metrics and the admin routes
    key_sha256 = ["..."]

A digest is `printf %s "$KEY" | sha256sum`; `kvfence api-key` prints a fresh key and its digest.
A key arrives as `Authorization: Bearer KEY`; its digest is compared with every known digest in
constant time (`hmac.compare_digest`, no early exit), so neither the match nor its position shows
in the time taken. Without a file there are no keys: every request is the anonymous tenant and
/metrics is open, as before; each client address is then a fair share of its own within it
(`Tenant.share`), so one client's flood cannot take every slot (behind a proxy every request
comes from the proxy's address, and they share one).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import secrets
import tomllib
from pathlib import Path
from typing import Any

from kvfence.scheduler.core.tenants import ANONYMOUS, RESERVED_NAMES, Tenant

_DIGEST_LEN = 64
_TENANT_FIELDS = {"key_sha256", "max_running", "max_queued", "tokens_per_minute", "weight"}


class ApiKeysError(ValueError):
    """The keys file cannot be used; the message names the file and the entry."""


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    """A fresh API key: 256 random bits."""
    return "kvf-" + secrets.token_urlsafe(32)


@dataclasses.dataclass(frozen=True)
class ApiKeys:
    """`tenants`: (digest, tenant) for every key; `admin`: the admin keys' digests. `enabled`
    False (no file): every request is the anonymous tenant."""

    tenants: tuple[tuple[bytes, Tenant], ...] = ()
    admin: tuple[bytes, ...] = ()
    enabled: bool = False

    @classmethod
    def load(cls, path: str | Path | None) -> ApiKeys:
        if path is None:
            return cls()
        try:
            table = tomllib.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise ApiKeysError(f"--api-keys {path}: cannot read it: {e}") from None
        unknown = set(table) - {"tenants", "admin"}
        if unknown:
            raise ApiKeysError(f"--api-keys {path}: unknown tables {sorted(unknown)}; expected [tenants.NAME] and [admin]")
        tenants: list[tuple[bytes, Tenant]] = []
        seen: set[bytes] = set()
        for name, entry in _tables(path, table.get("tenants", {}), "tenants").items():
            if name in RESERVED_NAMES:
                raise ApiKeysError(f"--api-keys {path}: tenant name {name!r} is reserved")
            bad = set(entry) - _TENANT_FIELDS
            if bad:
                raise ApiKeysError(f"--api-keys {path}: [tenants.{name}] has unknown keys {sorted(bad)}; "
                                   f"expected {sorted(_TENANT_FIELDS)}")
            limits = {k: v for k, v in entry.items() if k != "key_sha256"}
            try:
                tenant = Tenant(name=name, **limits)
            except ValueError as e:
                raise ApiKeysError(f"--api-keys {path}: [tenants.{name}]: {e}") from None
            for digest in _digests(path, f"tenants.{name}", entry.get("key_sha256")):
                if digest in seen:
                    raise ApiKeysError(f"--api-keys {path}: one key is listed twice (again in [tenants.{name}])")
                seen.add(digest)
                tenants.append((digest, tenant))
        if not tenants:
            raise ApiKeysError(f"--api-keys {path}: no tenant has a key; add a [tenants.NAME] table with key_sha256")
        admin = _tables(path, {"admin": table["admin"]}, "admin")["admin"] if "admin" in table else {}
        if set(admin) - {"key_sha256"}:
            raise ApiKeysError(f"--api-keys {path}: [admin] takes only key_sha256")
        admin_digests = tuple(_digests(path, "admin", admin.get("key_sha256"))) if admin else ()
        if seen & set(admin_digests):
            raise ApiKeysError(f"--api-keys {path}: an admin key is also a tenant key; give the admin its own")
        return cls(tuple(tenants), admin_digests, True)

    def tenant(self, authorization: str | None) -> Tenant | None:
        """The tenant a request's Authorization header authenticates; None: missing or wrong key."""
        if not self.enabled:
            return ANONYMOUS
        presented = _presented(authorization)
        found = None
        for digest, tenant in self.tenants:  # every digest is compared: the time does not depend on which matched
            if hmac.compare_digest(presented, digest):
                found = tenant
        return found

    def is_admin(self, authorization: str | None) -> bool:
        """True when keys are off, or the header carries an admin key."""
        if not self.enabled:
            return True
        presented = _presented(authorization)
        return any([hmac.compare_digest(presented, digest) for digest in self.admin])


def _presented(authorization: str | None) -> bytes:
    scheme, _, key = (authorization or "").partition(" ")
    key = key.strip() if scheme.lower() == "bearer" else ""
    return hashlib.sha256(key.encode()).digest() if key else b""


def _tables(path: str | Path, value: Any, where: str) -> dict[str, dict[str, Any]]:
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise ApiKeysError(f"--api-keys {path}: [{where}] must hold tables, one per name")
    return value


def _digests(path: str | Path, where: str, value: Any) -> list[bytes]:
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not values:
        raise ApiKeysError(f"--api-keys {path}: [{where}] needs key_sha256, a digest or a list of them")
    out = []
    for v in values:
        if not isinstance(v, str) or len(v) != _DIGEST_LEN or any(c not in "0123456789abcdef" for c in v.lower()):
            raise ApiKeysError(f"--api-keys {path}: [{where}] key_sha256 entries are 64 hex digits (the SHA-256 of the "
                               f"key, e.g. printf %s \"$KEY\" | sha256sum), got {v!r}")
        out.append(bytes.fromhex(v))
    return out
