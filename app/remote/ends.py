"""The halves of a transfer across the control connection, from their declarations alone.

scheduler/transfer.py declares the two halves a transfer is moved by, `SendingEnd` (a prefill
worker's sender, paired with one receiver) and `ReceivingEnd` (a decode worker's receiver). Here
each declared method becomes a call on the control connection (protocol.py's `EndCall`: the
half, the method's name, its arguments typed as the declaration types them) without a line
written for it: `remote_sending_end` and `remote_receiving_end` give the scheduler an object with every method of the half, and
`invoke` runs a call on the worker against its local half (scheduler/transfer.py's
`LocalSendingEnd`, `LocalReceivingEnd`). A new method is one edit to the declaration plus its
implementations; a method's name that the declaration does not have is refused, and arguments
are decoded to their declared types (what the worker runs is what the declaration allows).

What a call that fails returns follows from what the method returns, so no method needs its own:
- a TransferResult: a failed one, for the transfer the call names (its `transfer_id`, or its
  `manifest`'s), with the worker's message as the reason; a lost worker raises WorkerLost;
- a bool (an acknowledgement): False, also when the worker is lost (it acknowledged nothing);
- None: ValueError with the worker's message (`expect`: the receiver refused to arm).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Awaitable, Callable
from typing import Any, Literal, cast

import msgspec

from kvfence.app.remote.protocol import AnswerBody, EndCall, EndReturn, failure_message
from kvfence.engine.protocol import WorkerLost
from kvfence.scheduler.transfer import ReceivingEnd, SendingEnd
from kvfence.transports.base import TransferResult

Half = Literal["sending", "receiving"]
DECLARATIONS: dict[Half, type] = {"sending": SendingEnd, "receiving": ReceivingEnd}
_encoder = msgspec.json.Encoder()


@dataclasses.dataclass(frozen=True)
class Method:
    """One declared method: its arguments as a struct (their names and types, in order), and what
    it returns."""

    name: str
    args: type[msgspec.Struct]
    returns: Any
    waits_on_transfer: bool  # bounded by the transfer, not a call deadline (scheduler/transfer.py)
    decode_args: Callable[[bytes], Any]
    decode_return: Callable[[bytes], Any]


@functools.cache
def methods(half: Half) -> dict[str, Method]:
    """Every method the declaration of `half` has, by name."""
    declaration = DECLARATIONS[half]
    found = {}
    for name, fn in inspect.getmembers(declaration, inspect.isfunction):
        if name.startswith("_"):
            continue
        hints = typing.get_type_hints(fn)
        params = [p for p in inspect.signature(fn).parameters if p != "self"]
        args = msgspec.defstruct(f"{declaration.__name__}.{name}", [(p, hints[p]) for p in params],
                                 frozen=True, forbid_unknown_fields=True)
        returns = hints.get("return")
        found[name] = Method(name=name, args=args, returns=returns,
                             waits_on_transfer=getattr(fn, "waits_on_transfer", False),
                             decode_args=msgspec.json.Decoder(args).decode,
                             decode_return=msgspec.json.Decoder(returns).decode)
    return found


def waits_on_transfer(call: EndCall) -> bool:
    """Whether `call`'s method waits on the transfer (a method not declared: no)."""
    method = methods(call.end).get(call.method)
    return method is not None and method.waits_on_transfer


def transfer_id(args: msgspec.Struct) -> str:
    """The transfer a call's arguments name: its `transfer_id`, or its `manifest`'s."""
    transfer_id = getattr(args, "transfer_id", None)
    if transfer_id is None:
        transfer_id = getattr(getattr(args, "manifest", None), "transfer_id", "")
    return str(transfer_id)


def _failed(method: Method, args: msgspec.Struct, message: str) -> Any:
    """What a call of `method` that failed with `message` returns (the module docstring's rules)."""
    if method.returns is TransferResult:
        return TransferResult(transfer_id(args), False, message)
    if method.returns is bool:
        return False
    raise ValueError(message)


class _RemoteEnd:
    """A half on a worker reached through `ask` (app/remote/client.py's RemoteWorker.ask)."""

    def __init__(self, ask: Callable[[EndCall], Awaitable[AnswerBody]], half: Half, receiver: str) -> None:
        self._ask, self._half, self._receiver = ask, half, receiver

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        method = methods(self._half).get(name)
        if method is None:
            raise AttributeError(f"the {self._half} end declares no method {name!r}")

        async def call(*args: Any, **kwargs: Any) -> Any:
            bound = method.args(*args, **kwargs)
            try:
                answer = await self._ask(EndCall(end=self._half, method=name, args=msgspec.Raw(_encoder.encode(bound)),
                                                 receiver=self._receiver))
            except WorkerLost:
                if method.returns is bool:
                    return False
                raise
            if isinstance(answer, EndReturn):
                return method.decode_return(answer.value)
            return _failed(method, bound, failure_message(answer))

        return call


def remote_sending_end(ask: Callable[[EndCall], Awaitable[AnswerBody]], receiver: str) -> SendingEnd:
    """The sending half on the worker `ask` reaches, pushing to its receiver at endpoint address
    `receiver`."""
    return cast(SendingEnd, _RemoteEnd(ask, "sending", receiver))


def remote_receiving_end(ask: Callable[[EndCall], Awaitable[AnswerBody]]) -> ReceivingEnd:
    """The receiving half on the worker `ask` reaches."""
    return cast(ReceivingEnd, _RemoteEnd(ask, "receiving", ""))


def decoded(call: EndCall) -> tuple[Method, msgspec.Struct]:
    """The declared method `call` names and its arguments, decoded to their declared types;
    ValueError for a method the declaration does not have (or arguments it does not type so)."""
    method = methods(call.end).get(call.method)
    if method is None:
        raise ValueError(f"the {call.end} end declares no method {call.method!r}")
    return method, method.decode_args(call.args)


async def invoke(end: object, method: Method, args: msgspec.Struct) -> tuple[EndReturn, Any]:
    """Run `method` with `args` (from `decoded`) on the worker's local half `end`: (the answer,
    the value it returned)."""
    value = await getattr(end, method.name)(*(getattr(args, f) for f in args.__struct_fields__))
    return EndReturn(msgspec.Raw(_encoder.encode(value))), value
