"""The isolation guards a server runs with: all on, and off only where code assembles a server.

No setting, flag, TOML key or KVFENCE_* variable names a guard (tests/app/serve/test_guards.py checks the
declarations), so an operator cannot turn one off by accident. A program that builds a server itself
may pass `Guards.none()` (or any of them off) to `app/serve/server.serve`, to measure what the guards
cost (scripts/bench_guards.py); the server then logs a warning naming every guard that is off.

Where each guard lives and what turning it off skips:
- `owner_tags`: the owner-tag check of every page a step reads or writes (engine/owner_check.py,
  `ModelRunner(owner_check=...)`). Pages are still tagged and untagged: that is the ledger's state.
- `digests`: the xxh3 digests of every page a transfer moves (the pair's `PairingRecord.digest` is
  "none": nothing is hashed, and a transfer is judged on its page count).
- `capabilities`: the front end's signature on every push (`TransferLink` signs none, and the tcp
  receiver checks none: `TcpTransport(capabilities=False)`).
- `sealing`: AES-256-GCM records after the handshake (transports/wire/seal.py). The handshake still
  authenticates both ends (under a label of its own, so an unsealed end never pairs with a sealed
  one), then the same records travel in clear: `TcpTransport(sealed=False)`.
- `scrub`: freed pages filled as --kv-scrub says (engine/kv_pool.py); off, they keep their bytes.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Guards:
    owner_tags: bool = True
    digests: bool = True
    capabilities: bool = True
    sealing: bool = True
    scrub: bool = True

    @classmethod
    def none(cls) -> Guards:
        """Every guard off: only to measure what they cost."""
        return cls(**{f.name: False for f in dataclasses.fields(cls)})

    def off(self) -> list[str]:
        """The names of the guards that are off."""
        return [f.name for f in dataclasses.fields(self) if not getattr(self, f.name)]

    def endpoint_options(self) -> dict[str, Any]:
        """Keyword arguments of a tcp endpoint for the guards that are off (none when every guard is
        on, so a guarded server builds its endpoints exactly as it would without this)."""
        return {**({} if self.sealing else {"sealed": False}),
                **({} if self.capabilities else {"capabilities": False})}

    def warn(self) -> None:
        """Log, loudly, every guard that is off (nothing when all are on)."""
        if off := self.off():
            log.warning("ISOLATION GUARDS OFF: %s. This server does not keep kvfence's isolation guarantees; it "
                        "exists only to measure what they cost. Never serve anyone with it.", ", ".join(off))
