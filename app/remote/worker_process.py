"""`kvfence worker`: one worker (model, KV pool, KV transport endpoint) in its own process.

It serves one scheduler at a time over an authenticated control connection (app/remote/server.py)
on `--control HOST:PORT`; `kvfence serve --discovery ...` finds it and drives it. The settings are
`kvfence serve`'s (model, dtype, pools, transport, deployment secret); `--role` says which pool it
holds and `--device` where.
"""

from __future__ import annotations

import logging
import signal

import anyio

from kvfence.app.config.config import LISTENING_TRANSPORTS, ServeConfig
from kvfence.app.remote.discovery import parse_discovery
from kvfence.app.remote.membership import Registration, register_worker
from kvfence.app.remote.server import KvEndpoint, WorkerServer
from kvfence.app.serve.gc_heap import startup_heap_frozen
from kvfence.app.serve.pairing import role_record
from kvfence.app.serve.server import model_identity
from kvfence.app.serve.workers import build_role_worker
from kvfence.engine.checkpoint import Checkpoint
from kvfence.transports.core.front_key import FrontPublicKey
from kvfence.transports.core.secret import DeploymentSecret
from kvfence.transports.registry import create_transport
from kvfence.transports.wire.channel import listen, split_address

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")


def registration(server: WorkerServer, control: str, transport: str) -> Registration:
    """What etcd says of this worker now (its incarnation changes when its scheduler goes)."""
    d = server.describe()
    return Registration(role=d.role, incarnation=d.incarnation, control=control, device=d.device, num_pages=d.num_pages,
                        transport=transport, endpoint=d.endpoint.address if d.endpoint else "")


def check_worker_settings(config: ServeConfig, role: str) -> tuple[DeploymentSecret, FrontPublicKey]:
    """ValueError, naming the flag, for settings a worker in its own process cannot run with;
    else the deployment secret and the front end's public key, read from their files (which
    raise what DeploymentSecret.from_file and FrontPublicKey.from_file raise)."""
    if role not in ROLES:
        raise ValueError(f"--role must be one of {', '.join(ROLES)}, got {role!r}")
    if config.transport.name not in LISTENING_TRANSPORTS:
        raise ValueError(f"--transport {config.transport.name} moves KV only inside one process; a worker in its "
                         f"own process needs one of {', '.join(LISTENING_TRANSPORTS)}")
    if config.discovery and parse_discovery(config.discovery).etcd is None:
        raise ValueError("a worker registers itself only in etcd: --discovery etcd://HOST:PORT (or none, for a "
                         "front end that lists the workers with static://)")
    if not config.transport.secret_file:
        raise ValueError("a worker in its own process needs the deployment secret its scheduler and peers share: "
                         "--transport-secret-file (or KVFENCE_TRANSPORT_SECRET_FILE)")
    if not config.transport.front_public_key_file:
        raise ValueError("a worker in its own process needs the public key of its front end, which signs every "
                         "step and every capability: --front-public-key-file (or KVFENCE_FRONT_PUBLIC_KEY_FILE; "
                         "make a pair with: kvfence front-key)")
    return (DeploymentSecret.from_file(config.transport.secret_file),
            FrontPublicKey.from_file(config.transport.front_public_key_file))


async def run_worker(config: ServeConfig, checkpoint: Checkpoint, model_name: str, role: str, device: str,
                     control: str, advertise: str | None = None, intra_op_threads: int | None = None) -> int:
    """Serve the worker until SIGTERM/SIGINT, then drain it (WorkerServer.drain) and stop; 0 then.
    With `--discovery etcd://...` it registers there (app/remote/membership.py) under `advertise`
    (default: `control`), and revokes that last."""
    secret, front_key = check_worker_settings(config, role)
    host, port = split_address(control)
    if advertise is None and host in ("0.0.0.0", "::"):
        raise ValueError(f"--control {control} listens on every address: say which one front ends reach it at "
                         "with --advertise HOST:PORT")
    built = build_role_worker(config, checkpoint, role, device, intra_op_threads)
    try:
        worker, compute, context = built.worker, built.compute, built.max_context_tokens
        pool = worker.pool
        model_id = model_identity(checkpoint, model_name)
        transport = config.transport
        endpoint = KvEndpoint(
            lambda: create_transport(transport.name, secret=secret, front_key=front_key,
                                     **transport.endpoint_options(role)),
            pool.data, lambda: role_record(pool, model_id, context))
        server = WorkerServer(worker, compute, endpoint, secret, checkpoint.tokenizer, front_key=front_key,
                              model=model_id, max_context_tokens=context)
        listener = listen(host, port)
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(server.serve, listener)
                bound = listener.getsockname()
                log.info("%s worker (%s, %d pages) ready for its scheduler on %s:%d; KV endpoint %s over %s",
                         role, worker.device, pool.num_pages, bound[0], bound[1],
                         endpoint.info.address if endpoint.info else "-", transport.name)
                etcd = parse_discovery(config.discovery).etcd if config.discovery else None
                if etcd is not None:
                    advertised = advertise or f"{host}:{bound[1]}"
                    tg.start_soon(register_worker, *etcd, lambda: registration(server, advertised, transport.name),
                                  secret)
                with startup_heap_frozen(), anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for signum in signals:
                        log.info("received %s: draining the %s worker", signal.Signals(signum).name, role)
                        break
                await server.drain(config.server.shutdown_timeout_s)
                tg.cancel_scope.cancel()  # the etcd registration is revoked on the way out, last
        finally:
            listener.close()
        return 0
    finally:
        built.compute.close()
