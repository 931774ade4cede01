"""The `kvfence` command: `serve`, `check` (KV pool sizing), `generate` (offline, colocated) and `fetch`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvfence.app.config.environment import kvfence_home

if TYPE_CHECKING:  # imported where used: `kvfence --help` loads neither torch nor the engine
    import torch

    from kvfence.engine.model_config import ModelConfig


# The settings `generate` shares with `serve` (their dests); the rest of its flags are per prompt.
_GENERATE_SETTINGS = ("model", "dtype", "weights", "page_size_tokens", "attention_backend", "chunk_tokens")


def _build_parser() -> argparse.ArgumentParser:
    """Every settings flag comes from its declaration (app/config/config.py), with default None so the
    config file and the environment still apply."""
    from kvfence.app.config.command_options import declared_root
    from kvfence.app.config.config import ServeConfig
    from kvfence.app.config.settings import add_flags

    parser = argparse.ArgumentParser(prog="kvfence", description="Disaggregated LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    sources = ("Every setting is also a KVFENCE_<NAME> variable and a key of the --config TOML file; "
               "`kvfence config-reference` lists them all.")

    gen = sub.add_parser("generate", help="generate from one prompt, without a server", epilog=sources)
    gen.add_argument("prompt", help="prompt text")
    gen.add_argument("--config", type=Path, default=None, help="TOML file with these settings")
    add_flags(gen, ServeConfig, only=_GENERATE_SETTINGS)
    add_flags(gen, declared_root("generate"))

    for name, help in (("serve", "serve the OpenAI-compatible HTTP API"),
                       ("check", "check the KV pool sizes against the context, without loading weights")):
        p = sub.add_parser(name, help=help, epilog=sources)
        p.add_argument("--config", type=Path, default=None, help="TOML file with these settings")
        add_flags(p, ServeConfig)

    worker = sub.add_parser("worker", help="run one prefill or decode worker in its own process, for a front end "
                                           "started with --discovery", epilog=sources)
    worker.add_argument("--config", type=Path, default=None, help="TOML file with these settings")
    add_flags(worker, declared_root("worker"))
    add_flags(worker, ServeConfig)

    front = sub.add_parser("front-key", help="make the front end's signing key and its public half: front ends "
                                             "serve with --front-key-file, workers with --front-public-key-file")
    front.add_argument("--config", type=Path, default=None, help="TOML file with these settings")
    add_flags(front, declared_root("front-key"))

    sub.add_parser("config-reference", help="print every setting (TOML key, flag, variable, default) as markdown")
    key = sub.add_parser("api-key", help="print a fresh API key for a tenant and the --api-keys entry that holds "
                                         "its digest (the key itself is shown once, never stored)")
    key.add_argument("tenant", help="the tenant's name")

    probe = sub.add_parser("probe", help="probe any OpenAI-compatible endpoint for cross-tenant leaks (canaries, "
                                         "over-long prompts, transfer fields, prefix-cache timing, error envelope)")
    probe.add_argument("url", help="the server's base URL, e.g. http://127.0.0.1:8000")
    probe.add_argument("--config", type=Path, default=None, help="TOML file with these settings")
    add_flags(probe, declared_root("probe"))

    status = sub.add_parser("status", help="list a deployment's workers: role, incarnation, device, pool pages and "
                                           "health (from etcd and a front end's /metrics)")
    status.add_argument("--config", type=Path, default=None, help="TOML file with these settings")
    add_flags(status, declared_root("status"))

    fetch = sub.add_parser("fetch", help="fetch a known model into the cache and print its path")
    fetch.add_argument("model", nargs="?", default=None)
    return parser


def _generate(args: argparse.Namespace) -> int:
    import os

    import torch

    from kvfence.app.config.config import load_config
    from kvfence.engine.chat_template import render_chat
    from kvfence.engine.kv_pool import KVPool
    from kvfence.engine.models.registry import build_model
    from kvfence.engine.loading import load_model_spec, pick_device, pick_dtype
    from kvfence.engine.runner import ModelRunner
    from kvfence.engine.sampling import SamplingParams
    from kvfence.scheduler.offline import OfflineEngine

    config = load_config(vars(args), os.environ, args.config)
    opts = _options("generate", args)
    device = pick_device(opts.device)
    dtype = pick_dtype(config.workers.dtype, device)
    params = SamplingParams(temperature=opts.temperature, top_p=opts.top_p, top_k=opts.top_k, seed=opts.seed,
                            max_tokens=opts.max_tokens, stop=opts.stop, ignore_eos=opts.ignore_eos)
    checkpoint = load_model_spec(config.model, kvfence_home(), keep_blocks=config.workers.weights == "native")
    tok = checkpoint.tokenizer
    if opts.chat:
        text = render_chat(tok.chat_template, [{"role": "user", "content": args.prompt}],
                           bos_token=tok.special_token_text(tok.bos_token_id))
        prompt_ids = tok.encode(text, add_bos=False)
    else:
        prompt_ids = tok.encode(args.prompt)
    num_tokens = len(prompt_ids) + opts.max_tokens
    page_size_tokens = config.pools.page_size_tokens
    num_pages = -(-num_tokens // page_size_tokens)
    model = build_model(checkpoint, dtype, device, attention_backend=config.workers.attention_backend)
    del checkpoint
    pool = KVPool(model.config, num_pages, page_size_tokens, dtype, device)
    engine = OfflineEngine(ModelRunner(model, pool), tok, chunk_tokens=config.scheduler.chunk_tokens_for(device.type))
    with torch.inference_mode():
        out = engine.generate([prompt_ids], [params])[0]
    if opts.json:
        print(json.dumps({"prompt_token_ids": out.prompt_token_ids, "generated_token_ids": out.generated_token_ids,
                          "text": out.text, "finish_reason": out.finish_reason}))
    else:
        print(out.text)
    return 0


def _serve(args: argparse.Namespace) -> int:
    import logging
    import os

    import anyio

    from kvfence.app.api.keys import ApiKeys
    from kvfence.app.config.config import load_config
    from kvfence.app.remote.discovery import parse_discovery
    from kvfence.app.serve.server import serve
    from kvfence.app.serve.sizing import plan_pools, resolve_context
    from kvfence.engine.attention_backend import resolve_backend_name
    from kvfence.engine.checkpoint import load_checkpoint
    from kvfence.engine.compute import confine_to_one_intra_op_thread
    from kvfence.engine.loading import checkpoint_cache, pick_device, pick_dtype
    from kvfence.engine.known_models import resolve_model, served_name
    from kvfence.transports.core.front_key import FrontKey
    from kvfence.transports.core.secret import DeploymentSecret

    # Before any torch op here: only the devices' compute threads get intra-op threads (engine/compute.py).
    intra_op_threads = confine_to_one_intra_op_thread()
    config = load_config(vars(args), os.environ, args.config)
    logging.basicConfig(level=config.server.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.transport.secret_file:  # an unreadable or short secret fails before any weight is read
        DeploymentSecret.from_file(config.transport.secret_file)
    if config.transport.front_key_file:  # so does a bad front key
        FrontKey.from_file(config.transport.front_key_file)
    ApiKeys.load(config.server.api_keys)  # so does a bad keys file
    path = resolve_model(config.model, kvfence_home())
    # Refuse an undersized pool before reading any weights (build_workers checks again).
    model = _read_model_config(path)
    workers = config.workers
    element_size = pick_dtype(workers.dtype, pick_device(workers.prefill_device)).itemsize
    for device in (workers.prefill_device, workers.decode_device):  # a bad backend fails before weights load
        resolve_backend_name(workers.attention_backend, pick_device(device))
    if config.discovery is None:  # the pools are the workers' own when they run elsewhere
        resolve_context(config, model, plan_pools(config, model, element_size))
    else:
        parse_discovery(config.discovery)
    # the workers hold the weights
    checkpoint = load_checkpoint(path, weights=config.discovery is None,
                                 cache_dir=checkpoint_cache(kvfence_home()),
                                 keep_blocks=config.workers.weights == "native")
    name = config.served_model_name or served_name(config.model)
    if config.discovery is not None:
        from kvfence.app.remote.front import serve_remote  # a front end of workers in other processes

        return anyio.run(serve_remote, config, checkpoint, name)
    return anyio.run(serve, config, checkpoint, name, intra_op_threads)


def _worker(args: argparse.Namespace) -> int:
    import logging
    import os

    import anyio

    from kvfence.app.config.config import load_config
    from kvfence.app.remote.worker_process import check_worker_settings, run_worker
    from kvfence.app.serve.sizing import plan_pools, resolve_context
    from kvfence.engine.checkpoint import load_checkpoint
    from kvfence.engine.compute import confine_to_one_intra_op_thread
    from kvfence.engine.loading import checkpoint_cache, pick_device, pick_dtype
    from kvfence.engine.known_models import resolve_model, served_name
    from kvfence.transports.wire.channel import split_address

    intra_op_threads = confine_to_one_intra_op_thread()
    config = load_config(vars(args), os.environ, args.config)
    logging.basicConfig(level=config.server.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    opts = _options("worker", args)
    if opts.role is None:
        raise ValueError("--role is needed: prefill or decode (or KVFENCE_WORKER_ROLE, or role in [worker])")
    check_worker_settings(config, opts.role)  # reads the secret and the front end's key: a bad file fails now
    split_address(opts.control)
    path = resolve_model(config.model, kvfence_home())
    model = _read_model_config(path)  # an undersized pool fails before any weight is read
    resolve_context(config, model, plan_pools(config, model, pick_dtype(config.workers.dtype,
                                                                        pick_device(opts.device)).itemsize))
    checkpoint = load_checkpoint(path, cache_dir=checkpoint_cache(kvfence_home()),
                                 keep_blocks=config.workers.weights == "native")
    name = config.served_model_name or served_name(config.model)
    return anyio.run(run_worker, config, checkpoint, name, opts.role, opts.device, opts.control, opts.advertise,
                     intra_op_threads)


def _read_model_config(path: Path) -> ModelConfig:
    """The model's config from its GGUF metadata or config.json alone: no weight is read."""
    from kvfence.engine.checkpoint import read_config
    from kvfence.engine.loading import checkpoint_cache

    return read_config(path, checkpoint_cache(kvfence_home()))


def _check(args: argparse.Namespace) -> int:
    """Print each KV pool's size against the context; 0 when every pool holds it (after
    --clamp-context, if given), 1 with the fix printed when one does not."""
    import os

    from kvfence.app.config.config import load_config
    from kvfence.app.serve.sizing import (UndersizedPoolError, configured_context, plan_pools, render_table,
                                          resolve_context)
    from kvfence.engine.loading import pick_device, pick_dtype
    from kvfence.engine.known_models import resolve_model

    config = load_config(vars(args), os.environ, args.config)
    model = _read_model_config(resolve_model(config.model, kvfence_home()))
    dtype = pick_dtype(config.workers.dtype, pick_device(config.workers.prefill_device))
    plans = plan_pools(config, model, dtype.itemsize)
    try:
        context, verdicts = resolve_context(config, model, plans)
    except UndersizedPoolError as e:
        print(render_table(e.verdicts))
        print(f"kvfence: error: {e}", file=sys.stderr)
        return 1
    print(render_table(verdicts))
    configured = configured_context(config, model)
    if context != configured:
        print(f"context clamped from {configured} to {context} tokens (--clamp-context)")
    print(_weights_line(resolve_model(config.model, kvfence_home()), config.workers.weights, dtype))
    return 0


def _weights_line(path: Path, weights: str, dtype: torch.dtype) -> str:
    """What `kvfence check` says of the weights: the bytes a worker holds, by how it holds them."""
    from kvfence.engine.gguf_loader import read_metadata
    from kvfence.engine.loading import checkpoint_cache
    from kvfence.engine.weight_size import weight_bytes

    if path.is_dir():
        return "weights: a model directory, held as floats of --dtype"
    dtype_name = str(dtype).removeprefix("torch.")
    held = weight_bytes(read_metadata(path, checkpoint_cache(kvfence_home())), weights == "native", dtype_name,
                        dtype.itemsize)
    kinds = ", ".join(f"{kind} {size / 2**20:.1f}" for kind, size in sorted(held.by_kind.items()))
    shipped = ", ".join(f"{count} {kind}" for kind, count in sorted(held.file_kinds.items()))
    return f"weights (--weights {weights}): {held.total / 2**20:.1f} MiB per worker ({kinds} MiB); the file: {shipped}"


def _fetch(args: argparse.Namespace) -> int:
    from kvfence.engine.known_models import resolve_model

    print(resolve_model(args.model, kvfence_home()))
    return 0


def _api_key(args: argparse.Namespace) -> int:
    from kvfence.app.api.keys import key_digest, new_key
    from kvfence.scheduler.core.tenants import Tenant

    Tenant(name=args.tenant)  # a bad name fails here, not when the server reads the file
    key = new_key()
    print(f"# API key for tenant {args.tenant} (give it to the tenant; it is not stored anywhere):\n# {key}\n"
          f"[tenants.{args.tenant}]\nkey_sha256 = [\"{key_digest(key)}\"]")
    return 0


def _probe(args: argparse.Namespace) -> int:
    """Exit 0 when every check passed (or was skipped), 1 on any leak or failed check, 2 when the
    server could not be probed at all."""
    import json

    import httpx

    from kvfence.app.tools.probe import Prober, ok, report, table

    opts = _options("probe", args)
    prober = Prober(args.url, opts.key, opts.other_key, opts.model, context=opts.context, timeout_s=opts.timeout_s)
    try:
        checks = prober.run(progress=opts.progress)
    except httpx.HTTPError as e:
        print(f"kvfence probe: cannot probe {args.url}: {e}", file=sys.stderr)
        return 2
    finally:
        prober.close()
    print(json.dumps(report(args.url, checks), indent=1) if opts.json else table(checks))
    return 0 if ok(checks) else 1


def _config_reference() -> int:
    from kvfence.app.config.config import config_reference

    print(config_reference(), end="")
    return 0


def _status(args: argparse.Namespace) -> int:
    from kvfence.app.tools.status import status
    from kvfence.transports.core.secret import DeploymentSecret

    opts = _options("status", args)
    secret = DeploymentSecret.from_file(opts.transport_secret_file) if opts.transport_secret_file else None
    return status(opts.discovery, opts.front, opts.admin_key, opts.json, secret)


def _front_key(args: argparse.Namespace) -> int:
    """Write a fresh key pair; refuses to overwrite either file."""
    from kvfence.transports.core.front_key import FrontKey

    opts = _options("front-key", args)
    key = FrontKey.generate()
    key.write(opts.key, opts.public)
    print(f"front end key {opts.key} (for --front-key-file, front ends only) and its public half {opts.public} "
          f"(for --front-public-key-file, every worker); fingerprint {key.public.fingerprint}")
    return 0


def _options(command: str, args: argparse.Namespace) -> Any:
    """`command`'s options (app/config/command_options.py) from its flags, the environment and its table
    of the --config file."""
    import os

    from kvfence.app.config.command_options import load_options
    from kvfence.app.config.config import read_config_file

    return load_options(command, vars(args), os.environ, read_config_file(args.config), args.config)


# The commands that run the model: the CPU kernels they use build and switch as the environment says.
_RUNS_THE_MODEL = ("generate", "serve", "worker", "check")


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    from kvfence.engine.checkpoint import CheckpointError
    from kvfence.engine.known_models import FetchError

    if args.command in _RUNS_THE_MODEL:
        from kvfence.app.config.environment import kernel_place
        from kvfence.kernels.cpu import library

        library.use(kernel_place())
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "worker":
            return _worker(args)
        if args.command == "check":
            return _check(args)
        if args.command == "config-reference":
            return _config_reference()
        if args.command == "front-key":
            return _front_key(args)
        if args.command == "api-key":
            return _api_key(args)
        if args.command == "probe":
            return _probe(args)
        if args.command == "status":
            return _status(args)
        return _fetch(args)
    except (ValueError, FileNotFoundError, CheckpointError, FetchError) as e:
        print(f"kvfence: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
