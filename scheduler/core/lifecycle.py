"""A request's lifecycle: one transition table, and the only code that changes where a request is.

A request is in one `State` (where it is in the path), with one `Hold` on its pages (what besides
the scheduler may still touch them: a step in flight, or a transfer started) and at most one
`Exit` pending (an end or a retry asked for while something held its pages; it happens once
nothing does). Every change is an `Event` fired at its `Lifecycle`; `TABLE` says, for each event,
in which states, holds and pending exits it may happen and what it leaves. Anything else raises
IllegalTransition: a scheduler bug is caught where it happens, not pages later.

    WAITING -> PREFILLING -> TRANSFERRING -> DECODING -> FINISHED   (disaggregated)
    WAITING -> PREFILLING -> DECODING -> FINISHED                   (colocated)
    PREFILLING or DECODING -> WAITING                                (preempted: the pool ran out)
    PREFILLING, TRANSFERRING or DECODING -> WAITING                  (retried: a worker was lost)
    any live state -> ABORTED (client gone) or FAILED (server-side error)

Terminal states are monotone: once ABORTED or FAILED never FINISHED, and a second end is no
event at all (`Lifecycle.ended`). A step may still hold a request that ended (its worker's
restart ended it while its step ran elsewhere); the step's answer settles that hold.

No clock, no I/O: plain data, used by the scheduler core (scheduler/core/scheduler.py).
"""

from __future__ import annotations

import dataclasses
import enum

from kvfence.scheduler.core.errors import RequestError


class State(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"
    DECODING = "decoding"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


class Hold(enum.Enum):
    """What besides the scheduler may still touch the request's pages."""

    NONE = "none"
    STEP = "step"  # it is part of a step in flight to a worker
    TRANSFER = "transfer"  # its KV transfer was started and has not ended


class Exit(enum.Enum):
    """What was asked for while something held its pages, done once nothing does."""

    NONE = "none"
    END = "end"  # end with `Lifecycle.error`
    RETRY = "retry"  # a worker of its pair was lost: a new attempt, on another pair


class Event(enum.Enum):
    RESERVE = "reserve"  # pages reserved on a pair: it starts prefilling
    STEP_SENT = "step_sent"  # it is part of the step just sent
    STEP_SETTLED = "step_settled"  # that step answered, or its worker is gone
    PREFILLED = "prefilled"  # its prompt is in the prefill pool; its KV moves next
    DECODE = "decode"  # its KV is where its decode worker reads (landed, or one pool for both)
    TRANSFER_STARTED = "transfer_started"
    TRANSFER_ENDED = "transfer_ended"
    PREEMPT = "preempt"  # its pages were taken back: it queues again, to be recomputed
    ASK_END = "ask_end"  # end it once nothing holds its pages (the first end asked for wins)
    ASK_RETRY = "ask_retry"  # retry it once nothing holds its pages
    KEEP = "keep"  # no retry after all: the worker lost had already handed its KV on
    RETRY = "retry"  # retried: it queues again
    FINISH = "finish"  # its last token was sent
    ABORT = "abort"  # the client went away
    FAIL = "fail"  # a server-side error ended it


RUNNING = (State.PREFILLING, State.TRANSFERRING, State.DECODING)  # in path order (the core's indices keep it)
LIVE = frozenset({State.WAITING, *RUNNING})
TERMINAL = frozenset({State.FINISHED, State.ABORTED, State.FAILED})
ANY_STATE = LIVE | TERMINAL
ANY_HOLD = frozenset(Hold)
ANY_EXIT = frozenset(Exit)
IDLE = frozenset({Hold.NONE})


@dataclasses.dataclass(frozen=True)
class Rule:
    """Where an event may happen (`states`, `holds`, `exits`) and what it leaves (None: unchanged)."""

    states: frozenset[State]
    holds: frozenset[Hold] = IDLE
    exits: frozenset[Exit] = frozenset({Exit.NONE})
    state: State | None = None
    hold: Hold | None = None
    exit: Exit | None = None


TABLE: dict[Event, Rule] = {
    Event.RESERVE: Rule(states=frozenset({State.WAITING}), state=State.PREFILLING),
    Event.STEP_SENT: Rule(states=frozenset({State.PREFILLING, State.DECODING}), hold=Hold.STEP),
    Event.STEP_SETTLED: Rule(states=ANY_STATE, holds=frozenset({Hold.STEP}), exits=ANY_EXIT, hold=Hold.NONE),
    # a step's answer is taken even when an end waits: the end happens right after it
    Event.PREFILLED: Rule(states=frozenset({State.PREFILLING}), exits=ANY_EXIT, state=State.TRANSFERRING),
    Event.DECODE: Rule(states=frozenset({State.PREFILLING, State.TRANSFERRING}), exits=ANY_EXIT, state=State.DECODING),
    Event.TRANSFER_STARTED: Rule(states=frozenset({State.TRANSFERRING}), hold=Hold.TRANSFER),
    Event.TRANSFER_ENDED: Rule(states=frozenset({State.TRANSFERRING}), holds=frozenset({Hold.TRANSFER}), exits=ANY_EXIT,
                               hold=Hold.NONE),
    Event.PREEMPT: Rule(states=frozenset({State.PREFILLING, State.DECODING}), state=State.WAITING),
    # a second end asked for keeps the first's error
    Event.ASK_END: Rule(states=LIVE, holds=ANY_HOLD, exits=ANY_EXIT, exit=Exit.END),
    Event.ASK_RETRY: Rule(states=frozenset(RUNNING), holds=ANY_HOLD, exits=frozenset({Exit.NONE, Exit.RETRY}),
                          exit=Exit.RETRY),
    Event.KEEP: Rule(states=frozenset({State.TRANSFERRING}), exits=frozenset({Exit.RETRY}), exit=Exit.NONE),
    Event.RETRY: Rule(states=frozenset(RUNNING), exits=frozenset({Exit.RETRY}), state=State.WAITING, exit=Exit.NONE),
    Event.FINISH: Rule(states=frozenset({State.DECODING}), exits=ANY_EXIT, state=State.FINISHED, exit=Exit.NONE),
    # an end never waits for a step on another worker: that worker's next message untags the
    # pages before anything else can be granted them (one step in flight per worker, in order)
    Event.ABORT: Rule(states=LIVE, holds=frozenset({Hold.NONE, Hold.STEP}), exits=ANY_EXIT, state=State.ABORTED,
                      exit=Exit.NONE),
    Event.FAIL: Rule(states=LIVE, holds=frozenset({Hold.NONE, Hold.STEP}), exits=ANY_EXIT, state=State.FAILED,
                     exit=Exit.NONE),
}


class IllegalTransition(RuntimeError):
    pass


@dataclasses.dataclass
class Lifecycle:
    """Where one request is. Changed only by `fire`."""

    state: State = State.WAITING
    hold: Hold = Hold.NONE
    exit: Exit = Exit.NONE
    error: RequestError | None = None  # the end asked for (Exit.END)
    transfer: int = 0  # the key of its transfer while one is started (Hold.TRANSFER)

    @property
    def ended(self) -> bool:
        return self.state in TERMINAL

    @property
    def settled(self) -> bool:
        """Nothing but the scheduler can touch its pages: a pending exit may happen now."""
        return self.hold is Hold.NONE

    def fire(self, event: Event, who: str, *, error: RequestError | None = None, transfer: int = 0) -> None:
        """Apply `event` (`who` names the request in the error); IllegalTransition where `TABLE`
        does not allow it. ASK_END takes the `error` to end with; TRANSFER_STARTED the transfer's key."""
        rule = TABLE[event]
        if self.state not in rule.states or self.hold not in rule.holds or self.exit not in rule.exits:
            raise IllegalTransition(f"{who}: {event.value} in state {self.state.value} (held by {self.hold.value}, "
                                    f"pending exit {self.exit.value})")
        if event is Event.ASK_END:
            if error is None:
                raise ValueError(f"{who}: an end asked for needs its error")
            if self.exit is not Exit.END:
                self.error = error
        elif event is Event.TRANSFER_STARTED:
            if transfer <= 0:
                raise ValueError(f"{who}: a transfer started needs its key")
            self.transfer = transfer
        elif event is Event.TRANSFER_ENDED:
            self.transfer = 0
        self.state = rule.state or self.state
        self.hold = rule.hold or self.hold
        self.exit = rule.exit or self.exit
        if self.exit is not Exit.END:
            self.error = None
