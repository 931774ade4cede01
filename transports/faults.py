"""Fault injection for transports: wrap any `Transport` and misbehave, on purpose, on the sender
side of `push`, to exercise the receiver's checks and the server's timeout / cancel paths.

A plan is a comma-separated list of faults (the server reads it from `--fault-inject` or
`KVFENCE_FAULTS`; see `FaultPlan.parse`):

    drop          do not send; push returns a failed result ("dropped") and the receiver hears
                  nothing: its completion only ends through cancel (the server's timeout path)
    delay=S       sleep S seconds, then push
    duplicate     push the same manifest again right after the first push returned (the
                  receiver must refuse the second as "duplicate"); the first result is returned
    corrupt       the manifest carries the true digests, but one byte of the first source page is
                  flipped in the bytes sent (restored when the push returns): "digest_mismatch"
    truncate      send one page fewer than expected (needs >= 2 pages; a 1-page push is sent
                  as is and not counted): the receiver must refuse the shortened manifest
    fail_post     raise `InjectedFault` before anything is sent (a failed post)
    vanish        close the wrapped transport, then push (it fails; the pair is gone for good)
    late_write    after the push returned its verdict, push the same transfer id again with one
                  byte of every page flipped, so a landing would show; it must be refused
    reorder       hold the push until the next push through this wrapper has returned (at most
                  REORDER_HOLD_S), so the receiver sees transfers complete out of order; each must
                  still land exactly where it was expected
    stuck         the push never returns and this side never acknowledges its cancellation (as a
                  one-sided write that may still land): the server times out and must keep the
                  destination pages quarantined, never free

Each fault may carry one selector: `@P` fires with probability P (0..1) on each push, `#N` on
every N-th push through this wrapper (the N-th, 2N-th, ...); none: every push. Selection is
deterministic for a given seed and sequence of pushes. E.g. "corrupt@0.1,delay=0.05#4".

Counts of injected faults, by kind, are in `FaultInjectingTransport.injected`; the results of
the extra pushes (duplicate, late_write) in `extra_results`.
"""

from __future__ import annotations

import collections
import dataclasses
import random
import re
from typing import ClassVar

import anyio
import anyio.lowlevel
import msgspec
import torch
from anyio.abc import TaskGroup

from kvfence.transports.base import (EndpointInfo, PairingRecord, Peer, TransferManifest, TransferResult,
                                     Transport)
from kvfence.transports.core.digest import page_digest

FAULT_KINDS = ("drop", "delay", "corrupt", "truncate", "duplicate", "fail_post", "vanish", "late_write", "stuck",
               "reorder")
REORDER_HOLD_S = 1.0  # how long a reordered push waits for a later one at most
_SYNTAX = "NAME[=SECONDS][@PROBABILITY|#EVERY_NTH], comma-separated, e.g. 'corrupt@0.5,delay=0.2#3'"
_ITEM = re.compile(r"^(?P<kind>[a-z_]+)(?:=(?P<value>[^@#]*))?(?:(?P<sel>[@#])(?P<arg>.*))?$")


class InjectedFault(RuntimeError):
    """Raised by a push that the plan made fail before sending (`fail_post`)."""


@dataclasses.dataclass(frozen=True)
class FaultSpec:
    kind: str
    seconds: float = 0.0  # delay only
    probability: float = 1.0
    every: int = 0  # > 0: every N-th push (then `probability` is unused)

    def __str__(self) -> str:
        text = f"{self.kind}={self.seconds:g}" if self.kind == "delay" else self.kind
        if self.every:
            return f"{text}#{self.every}"
        return text if self.probability == 1.0 else f"{text}@{self.probability:g}"


@dataclasses.dataclass(frozen=True)
class FaultPlan:
    faults: tuple[FaultSpec, ...] = ()

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        """Parse "drop", "delay=0.5", "corrupt@0.2", "drop#3", ... (comma-separated; "" or
        "none": no faults). ValueError naming the problem, the known faults and the syntax."""
        specs: list[FaultSpec] = []
        if text.strip().lower() in ("", "none"):
            return cls()
        for raw in text.split(","):
            item = raw.strip()
            spec = _parse_item(item)
            if any(s.kind == spec.kind for s in specs):
                raise ValueError(f"fault {spec.kind!r} is given twice in {text!r}; give each fault once")
            specs.append(spec)
        return cls(tuple(specs))

    def __str__(self) -> str:
        return ",".join(map(str, self.faults)) or "none"

    def __bool__(self) -> bool:
        return bool(self.faults)

    def kinds(self) -> set[str]:
        return {s.kind for s in self.faults}

    def select(self, push_number: int, rng: random.Random) -> dict[str, FaultSpec]:
        """The faults that fire on the `push_number`-th push (1-based). Draws one number from
        `rng` per probabilistic fault on every push, fired or not, so the sequence is reproducible."""
        chosen = {}
        for spec in self.faults:
            if spec.every:
                fire = push_number % spec.every == 0
            else:
                fire = rng.random() < spec.probability
            if fire:
                chosen[spec.kind] = spec
        return chosen


def _parse_item(item: str) -> FaultSpec:
    def bad(problem: str) -> ValueError:
        return ValueError(f"bad fault {item!r}: {problem}; known faults: {', '.join(FAULT_KINDS)}; "
                          f"syntax: {_SYNTAX}")

    m = _ITEM.match(item)
    if m is None:
        raise bad("not of the form NAME[=VALUE][@P|#N]")
    kind, value, sel, arg = m["kind"], m["value"], m["sel"], m["arg"]
    if kind not in FAULT_KINDS:
        raise bad(f"unknown fault {kind!r}")
    seconds = 0.0
    if kind == "delay":
        if value is None:
            raise bad("delay needs seconds, e.g. 'delay=0.5'")
        try:
            seconds = float(value)
        except ValueError:
            raise bad(f"delay seconds {value!r} are not a number") from None
        if not 0 <= seconds < float("inf"):
            raise bad(f"delay seconds must be finite and >= 0, got {value!r}")
    elif value is not None:
        raise bad(f"{kind!r} takes no value")
    probability, every = 1.0, 0
    if sel == "@":
        try:
            probability = float(arg)
        except ValueError:
            raise bad(f"probability {arg!r} is not a number") from None
        if not 0.0 <= probability <= 1.0:
            raise bad(f"probability must be in [0, 1], got {arg!r}")
    elif sel == "#":
        if not arg.isdigit() or int(arg) < 1:
            raise bad(f"every-N-th needs a whole number >= 1, got {arg!r}")
        every = int(arg)
    return FaultSpec(kind=kind, seconds=seconds, probability=probability, every=every)


class FaultInjectingTransport(Transport):
    """Delegates everything to `inner`; on `push`, injects the faults `plan` selects (see the
    module docstring). `seed` makes probabilistic selection reproducible."""

    name: ClassVar[str] = "faults"

    def __init__(self, inner: Transport, plan: FaultPlan, seed: int = 0) -> None:
        self.inner = inner
        self.plan = plan
        self.injected: collections.Counter[str] = collections.Counter()  # fault kind -> times injected
        self.extra_results: list[TransferResult] = []  # verdicts of duplicate / late_write pushes
        self._stuck: set[str] = set()  # transfers whose cancellation this side never acknowledges
        self._held: list[anyio.Event] = []  # reordered pushes waiting for a later push to return
        self.pushes = 0
        self._rng = random.Random(seed)
        self._pages: torch.Tensor | None = None  # the sender's pool as (num_pages, page_nbytes) uint8
        self._digest = "none"

    # -- delegation ------------------------------------------------------------------------
    async def start(self, task_group: TaskGroup, memory: torch.Tensor, record: PairingRecord) -> EndpointInfo:
        info = await self.inner.start(task_group, memory, record)
        self._pages = memory.detach().reshape(memory.shape[0], -1).view(torch.uint8)
        self._digest = record.digest
        return info

    @property
    def info(self) -> EndpointInfo:
        return self.inner.info

    async def pair(self, peer: EndpointInfo) -> Peer:
        return await self.inner.pair(peer)

    def expect(self, manifest: TransferManifest, dst_pages: list[int]) -> None:
        self.inner.expect(manifest, dst_pages)

    async def completion(self, transfer_id: str) -> TransferResult:
        return await self.inner.completion(transfer_id)

    async def cancel(self, transfer_id: str) -> bool:
        acknowledged = await self.inner.cancel(transfer_id)
        return acknowledged and transfer_id not in self._stuck

    async def wait_quiet(self, transfer_id: str) -> bool:
        if transfer_id in self._stuck:  # a cancel that is never acknowledged never quiets either
            return False
        return await self.inner.wait_quiet(transfer_id)

    async def health(self) -> bool:
        return await self.inner.health()

    async def aclose(self) -> None:
        await self.inner.aclose()

    # -- the faults ------------------------------------------------------------------------
    async def push(self, peer: Peer, manifest: TransferManifest, src_pages: list[int],
                   dst_pages: list[int]) -> TransferResult:
        self.pushes += 1
        faults = self.plan.select(self.pushes, self._rng)
        tid = manifest.transfer_id
        if "fail_post" in faults:
            self.injected["fail_post"] += 1
            raise InjectedFault(f"injected fault: posting transfer {tid} failed")
        if "reorder" in faults:
            self.injected["reorder"] += 1
            later = anyio.Event()
            self._held.append(later)
            with anyio.move_on_after(REORDER_HOLD_S):
                await later.wait()
        else:
            try:
                return await self._push(peer, manifest, src_pages, dst_pages, faults)
            finally:  # this push went ahead of every push held before it
                held, self._held = self._held, []
                for event in held:
                    event.set()
        return await self._push(peer, manifest, src_pages, dst_pages, faults)

    async def _push(self, peer: Peer, manifest: TransferManifest, src_pages: list[int], dst_pages: list[int],
                    faults: dict[str, FaultSpec]) -> TransferResult:
        tid = manifest.transfer_id
        if "stuck" in faults:
            self.injected["stuck"] += 1
            self._stuck.add(tid)
            await anyio.sleep_forever()
        if "vanish" in faults:
            self.injected["vanish"] += 1
            await self.inner.aclose()
        elif "drop" in faults:
            self.injected["drop"] += 1
            await anyio.lowlevel.checkpoint()
            return TransferResult(tid, False, "dropped")
        if "delay" in faults:
            self.injected["delay"] += 1
            await anyio.sleep(faults["delay"].seconds)
        src, dst = list(src_pages), list(dst_pages)
        if "truncate" in faults and len(src) >= 2 and len(dst) >= 2:
            self.injected["truncate"] += 1
            src, dst = src[:-1], dst[:-1]
            # The built-ins refuse a push whose page lists disagree with its manifest before sending
            # anything, so the shortened push announces its shortened page count (and keeps the
            # original num_tokens): the receiver sees a manifest that is not the one it expects.
            manifest = msgspec.structs.replace(manifest, num_pages=len(src),
                                               digests=list(manifest.digests[:len(src)]))
        if "corrupt" in faults:
            self.injected["corrupt"] += 1
            manifest = msgspec.structs.replace(manifest, digests=self._true_digests(src))
            with self._flipped(src[:1]):
                result = await self.inner.push(peer, manifest, src, dst)
        else:
            result = await self.inner.push(peer, manifest, src, dst)
        if "duplicate" in faults:
            self.injected["duplicate"] += 1
            self.extra_results.append(await self.inner.push(peer, manifest, src, dst))
        if "late_write" in faults:
            self.injected["late_write"] += 1
            with self._flipped(src):
                self.extra_results.append(await self.inner.push(peer, manifest, src, dst))
        return result

    def _sender_pages(self) -> torch.Tensor:
        if self._pages is None:
            raise RuntimeError("fault-injecting transport not started")
        return self._pages

    def _true_digests(self, pages: list[int]) -> list[str]:
        pool = self._sender_pages()
        return [page_digest(pool[p].cpu().numpy().tobytes(), self._digest) for p in pages]

    def _flipped(self, pages: list[int]) -> _Flip:
        return _Flip(self._sender_pages(), pages)


class _Flip:
    """Context manager: invert the middle byte of each page of `pool` in `pages`, restore on exit
    (however the block ends)."""

    def __init__(self, pool: torch.Tensor, pages: list[int]) -> None:
        self.pool = pool
        self.pages = list(pages)
        self.at = pool.shape[1] // 2

    def _toggle(self) -> None:
        for p in self.pages:
            self.pool[p, self.at] = self.pool[p, self.at].bitwise_not()

    def __enter__(self) -> _Flip:
        self._toggle()
        return self

    def __exit__(self, *exc: object) -> None:
        self._toggle()
