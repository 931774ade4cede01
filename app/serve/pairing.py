"""Pairing the prefill worker's transport endpoint with the decode worker's, once, at start.

Each role describes its own pool in its `PairingRecord`: dtype, page size and bytes, layout and
the longest request it holds (`max_context_tokens`: the served context, or less if its pool is
smaller). The pair then serves the smaller of the two limits, fixed here, so admission knows it
before the first request (FAILURES 3). Any difference in a field that defines the bytes refuses
the pair as a whole: one ERROR line names both roles, the transport and the field, the endpoints
are closed and no request is ever routed to the pair (FAILURES 18).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from anyio.abc import TaskGroup

from kvfence.app.serve.guards import Guards
from kvfence.engine.ids import id_hex, mint_id
from kvfence.engine.kv_pool import KVPool
from kvfence.scheduler.core.prefix_cache import BLOCK_HASH_SCHEME
from kvfence.scheduler.transfer import TransferLink
from kvfence.transports.base import PairingRecord, PairingRefused, Peer, Transport
from kvfence.transports.core.front_key import FrontKey
from kvfence.transports.core.secret import DeploymentSecret
from kvfence.transports.faults import FaultInjectingTransport, FaultPlan
from kvfence.transports.registry import create_transport

log = logging.getLogger(__name__)

PAGE_LAYOUT = "pages,layers,kv,kv_heads,page_size,head_dim"
DIGEST = "xxh3_64"


def role_record(pool: KVPool, model_id: str, context_tokens: int, guards: Guards = Guards()) -> PairingRecord:
    """What one role's endpoint states at pairing: its pool's bytes and the longest request it holds
    (and, with the digest guard off, no page digest: app/serve/guards.py)."""
    return PairingRecord(
        model=model_id, dtype=str(pool.dtype).removeprefix("torch."), page_size_tokens=pool.page_size_tokens,
        page_nbytes=pool.page_nbytes, page_layout=PAGE_LAYOUT, digest=DIGEST if guards.digests else "none",
        max_context_tokens=min(context_tokens, pool.capacity_tokens), incarnation=id_hex(mint_id()),
        block_hash=BLOCK_HASH_SCHEME)


@dataclasses.dataclass
class PairedWorkers:
    link: TransferLink
    peer: Peer  # the receiver as the sender paired with it
    endpoints: list[Transport]  # the real endpoints (not fault wrappers), to close at shutdown
    max_context_tokens: int  # the smaller of the two roles' limits


async def pair_workers(tg: TaskGroup, transport: str, prefill: tuple[KVPool, PairingRecord],
                       decode: tuple[KVPool, PairingRecord], secret: DeploymentSecret, front_key: FrontKey,
                       fault_inject: str = "",
                       options: Mapping[str, Any] | None = None, *,
                       role_options: Mapping[str, Mapping[str, Any]] | None = None,
                       guards: Guards = Guards()) -> PairedWorkers:
    """Start a `transport` endpoint per role (constructed with the deployment `secret`, the public
    half of `front_key`, which signs every push's capability, `options`
    and that role's `role_options["prefill"|"decode"]`, e.g. where it listens) over its pool and
    pair prefill -> decode; `fault_inject` (a FaultPlan spec) wraps the sending side. `guards`:
    the endpoints' sealing and capabilities (app/serve/guards.py; the records carry the digest guard).

    Raises PairingRefused (after logging it and closing both endpoints) when the records disagree."""
    (prefill_pool, prefill_record), (decode_pool, decode_record) = prefill, decode
    own = role_options or {}
    credentials = {"secret": secret, "front_key": front_key.public, **guards.endpoint_options()}
    sender = create_transport(transport, **credentials, **(options or {}), **own.get("prefill", {}))
    receiver = create_transport(transport, **credentials, **(options or {}), **own.get("decode", {}))
    endpoints = [sender, receiver]
    if fault_inject:
        log.warning("FAULT INJECTION is on for KV transfers: %s", fault_inject)
        sender = FaultInjectingTransport(sender, FaultPlan.parse(fault_inject))
    try:
        receiver_info = await receiver.start(tg, decode_pool.data, decode_record)
        await sender.start(tg, prefill_pool.data, prefill_record)
        peer = await sender.pair(receiver_info)
    except PairingRefused as e:
        log.error("pairing refused: prefill -> decode over %s: %s; no request will be routed to this pair",
                  transport, e)
        for endpoint in endpoints:
            await endpoint.aclose()
        raise
    context = min(prefill_record.max_context_tokens, peer.info.record.max_context_tokens)
    link = TransferLink.local(sender, receiver, peer, prefill_record.page_size_tokens, prefill_record.page_nbytes,
                              front_key if guards.capabilities else None)
    log.info("paired prefill -> decode over %s (%s); context limits %d and %d tokens, serving %d",
             transport, receiver_info.address, prefill_record.max_context_tokens,
             peer.info.record.max_context_tokens, context)
    return PairedWorkers(link=link, peer=peer, endpoints=endpoints, max_context_tokens=context)
