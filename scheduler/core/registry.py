"""Every live request, each in the one index of its state: the queue (WAITING, in the order they
get pages) or the running index of its state; and each tenant's load (queued, running, tokens).

The indices follow the lifecycle (scheduler/core/lifecycle.py): `move`, `requeue` and `remove`
fire a request's events and keep its index and its tenant's load in step, so a request is never
in two indices or in none. Part of the scheduler core: no I/O, no clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping

from kvfence.scheduler.core.lifecycle import RUNNING, Event, State
from kvfence.scheduler.core.request import Request
from kvfence.scheduler.core.tenants import TenantLoads
from kvfence.scheduler.core.worker_binding import WorkerBinding


class Registry:
    def __init__(self) -> None:
        self.queue: deque[Request] = deque()  # WAITING, in the order they get pages
        self.tenants = TenantLoads()
        self._running: dict[State, dict[str, Request]] = {s: {} for s in RUNNING}
        self._live: dict[str, Request] = {}
        self._arrivals = 0

    def get(self, request_id: str) -> Request | None:
        """A live (not yet ended) request."""
        return self._live.get(request_id)

    def live(self) -> list[Request]:
        """Every live request, in admission order."""
        return list(self._live.values())

    def __len__(self) -> int:
        return len(self._live)

    @property
    def index(self) -> Mapping[State, Mapping[str, Request]]:
        """The running requests by state (read only: `move`, `requeue` and `remove` change it)."""
        return self._running

    def in_state(self, state: State) -> list[Request]:
        return list(self.queue) if state is State.WAITING else list(self._running[state].values())

    def running(self) -> Iterator[Request]:
        """Every running request: prefilling, then transferring, then decoding."""
        for group in self._running.values():
            yield from group.values()

    def num_running(self) -> int:
        return sum(len(group) for group in self._running.values())

    def transferring(self, key: int) -> Request:
        """The request whose transfer has key `key`."""
        return next(r for r in self._running[State.TRANSFERRING].values() if r.transfer == key)

    def add(self, req: Request, *, front: bool = False) -> None:
        """Admit `req` (WAITING): at the back of the queue, or with `front` behind the priority
        requests already waiting."""
        self._arrivals += 1
        req.arrival = self._arrivals
        self._live[req.request_id] = req
        self.tenants[req.tenant].queued += 1
        if front:
            self.queue.insert(self.queue_front(), req)
        else:
            self.queue.append(req)

    def queue_front(self) -> int:
        """Where a request goes to be next: behind the priority requests already waiting."""
        return next((i for i, r in enumerate(self.queue) if not r.priority), len(self.queue))

    def move(self, req: Request, event: Event) -> None:
        """`event` takes `req` forward to a running state; its index follows."""
        old = req.state
        req.fire(event)
        if old is State.WAITING:
            self.queue.remove(req)
            load = self.tenants[req.tenant]
            load.queued, load.running = load.queued - 1, load.running + 1
        else:
            del self._running[old][req.request_id]
        self._running[req.state][req.request_id] = req

    def requeue(self, req: Request, now: float, *, retry: bool = False) -> None:
        """Preempted or retried (its leases were released): back to the front of the queue, behind
        the priority requests, to prefill everything it has again as its next attempt."""
        was = req.state
        req.requeue(now, retry=retry)
        del self._running[was][req.request_id]
        load = self.tenants[req.tenant]
        load.queued, load.running = load.queued + 1, load.running - 1
        self.queue.insert(self.queue_front(), req)

    def remove(self, req: Request, was: State, now: float) -> None:
        """`req`, which was in state `was`, just ended: out of its index, its tenant given back
        what it was charged and did not use."""
        load = self.tenants[req.tenant]
        if was is State.WAITING:
            self.queue.remove(req)
            load.queued -= 1
        else:
            del self._running[was][req.request_id]
            load.running -= 1
        del self._live[req.request_id]
        load.spend(req.num_generated - req.max_tokens, now)

    def running_per_decode(self) -> dict[WorkerBinding, int]:
        """How many running requests each decode pool serves (their headroom pages)."""
        counts: dict[WorkerBinding, int] = {}
        for req in self.running():
            if req.pair is not None:
                counts[req.pair.decode] = counts.get(req.pair.decode, 0) + 1
        return counts

    def running_per_share(self) -> dict[str, int]:
        """How many requests each fair-share group runs."""
        running: dict[str, int] = {}
        for r in self.running():
            running[r.share] = running.get(r.share, 0) + 1
        return running
