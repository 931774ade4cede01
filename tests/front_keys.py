"""The test deployment's front end key (transports/core/front_key.py), one per test process: it
signs capabilities and control handshakes; workers and endpoints hold `FRONT.public`."""

from __future__ import annotations

from kvfence.transports.core.front_key import FrontKey

FRONT = FrontKey.generate()
