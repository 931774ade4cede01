"""The `kvfence` command: `serve`, `check` (KV pool sizing), `generate` (offline, colocated) and `fetch`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvfence.app.environment import kvfence_home

if TYPE_CHECKING:  # imported where used: `kvfence --help` loads neither torch nor the engine
    import torch

    from kvfence.engine.model_config import ModelConfig


# The settings `generate` shares with `serve` (their dests); the rest of its flags are per prompt.
_GENERATE_SETTINGS = ("model", "dtype", "weights", "page_size_tokens", "attention_backend", "chunk_tokens")


def _build_parser() -> argparse.ArgumentParser:
    """Every settings flag comes from its declaration (app/config.py), with default None so the
    config file and the environment still apply."""
    from kvfence.app.config import ServeConfig
    from kvfence.app.settings import add_flags

    parser = argparse.ArgumentParser(prog="kvfence", description="Disaggregated LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    sources = ("Every setting is also a KVFENCE_<NAME> variable and a key of the --config TOML file; "
               "`kvfence config-reference` lists them all.")

    gen = sub.add_parser("generate", help="generate from one prompt, without a server",
                         epilog="Its settings are also KVFENCE_<NAME> variables, as for `kvfence serve`.")
    add_flags(gen, ServeConfig, only=_GENERATE_SETTINGS)
    gen.add_argument("--device", default="auto", help="auto, cpu or cuda:N")
    gen.add_argument("prompt", help="prompt text")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--chat", action="store_true", help="wrap PROMPT as one user message in the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object with ids and text")

    for name, help in (("serve", "serve the OpenAI-compatible HTTP API"),
                       ("check", "check the KV pool sizes against the context, without loading weights")):
        p = sub.add_parser(name, help=help, epilog=sources)
        p.add_argument("--config", type=Path, default=None, help="TOML file with these settings")
        add_flags(p, ServeConfig)

    worker = sub.add_parser("worker", help="run one prefill or decode worker in its own process, for a front end "
                                           "started with --discovery", epilog=sources)
    worker.add_argument("--config", type=Path, default=None, help="TOML file with these settings")
    worker.add_argument("--role", required=True, choices=("prefill", "decode"), help="the pool this worker holds")
    worker.add_argument("--device", default="auto", help="auto, cpu or cuda:N (one worker process per GPU)")
    worker.add_argument("--control", default="127.0.0.1:0", help="HOST:PORT its scheduler connects to "
                                                                   "(authenticated with the deployment secret)")
    worker.add_argument("--advertise", default=None, help="HOST:PORT front ends reach --control at, as registered "
                                                          "in etcd (default: --control)")
    add_flags(worker, ServeConfig)

    front = sub.add_parser("front-key", help="make the front end's signing key and its public half: front ends "
                                             "serve with --front-key-file, workers with --front-public-key-file")
    front.add_argument("--key", type=Path, default=Path("front.key"), help="where the private key goes (mode 600)")
    front.add_argument("--public", type=Path, default=Path("front.pub"), help="where the public key goes")

    sub.add_parser("config-reference", help="print every setting (TOML key, flag, variable, default) as markdown")
    key = sub.add_parser("api-key", help="print a fresh API key for a tenant and the --api-keys entry that holds "
                                         "its digest (the key itself is shown once, never stored)")
    key.add_argument("tenant", help="the tenant's name")

    probe = sub.add_parser("probe", help="probe any OpenAI-compatible endpoint for cross-tenant leaks (canaries, "
                                         "over-long prompts, transfer fields, prefix-cache timing, error envelope)")
    probe.add_argument("url", help="the server's base URL, e.g. http://127.0.0.1:8000")
    probe.add_argument("--key", default=None, help="API key of tenant A (the one that plants canaries); also "
                                                   "KVFENCE_PROBE_KEY")
    probe.add_argument("--other-key", default=None, help="API key of tenant B (the one that must never see A's); "
                                                         "also KVFENCE_PROBE_OTHER_KEY. Without it B is A")
    probe.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    probe.add_argument("--context", type=int, default=None, help="advertised context in tokens (default: "
                                                                  "max_model_len of /v1/models, else 2048)")
    probe.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    probe.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    probe.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

    status = sub.add_parser("status", help="list a deployment's workers: role, incarnation, device, pool pages and "
                                           "health (from etcd and a front end's /metrics)")
    status.add_argument("--discovery", default=None, help="etcd://HOST:PORT the workers register in")
    status.add_argument("--front", default=None, help="a front end's base URL, e.g. http://127.0.0.1:8000 (its "
                                                      "/metrics has each worker's pool)")
    status.add_argument("--admin-key", default=None, help="the front end's admin key, when it serves with "
                                                          "--api-keys (also KVFENCE_ADMIN_KEY)")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.add_argument("--transport-secret-file", default=None,
                        help="the deployment secret: list only registrations signed with it (without it, etcd's "
                             "registrations are shown unverified)")

    fetch = sub.add_parser("fetch", help="fetch a known model into the cache and print its path")
    fetch.add_argument("model", nargs="?", default=None)
    return parser


def _generate(args: argparse.Namespace) -> int:
    import os

    import torch

    from kvfence.app.config import load_config
    from kvfence.engine.chat_template import render_chat
    from kvfence.engine.kv_pool import KVPool
    from kvfence.engine.llama import LlamaModel
    from kvfence.engine.loading import load_model_spec, pick_device, pick_dtype
    from kvfence.scheduler.offline import OfflineEngine
    from kvfence.engine.runner import ModelRunner
    from kvfence.engine.sampling import SamplingParams

    config = load_config(vars(args), os.environ, None)
    device = pick_device(args.device)
    dtype = pick_dtype(config.workers.dtype, device)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_tokens=args.max_tokens, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    checkpoint = load_model_spec(config.model, kvfence_home(), keep_blocks=config.workers.weights == "native")
    tok = checkpoint.tokenizer
    if args.chat:
        text = render_chat(tok.chat_template, [{"role": "user", "content": args.prompt}],
                           bos_token=tok.special_token_text(tok.bos_token_id))
        prompt_ids = tok.encode(text, add_bos=False)
    else:
        prompt_ids = tok.encode(args.prompt)
    num_tokens = len(prompt_ids) + args.max_tokens
    page_size_tokens = config.pools.page_size_tokens
    num_pages = -(-num_tokens // page_size_tokens)
    model = LlamaModel(checkpoint, dtype, device, attention_backend=config.workers.attention_backend)
    del checkpoint
    pool = KVPool(model.config, num_pages, page_size_tokens, dtype, device)
    engine = OfflineEngine(ModelRunner(model, pool), tok, chunk_tokens=config.scheduler.chunk_tokens_for(device.type))
    with torch.inference_mode():
        out = engine.generate([prompt_ids], [params])[0]
    if args.json:
        print(json.dumps({"prompt_token_ids": out.prompt_token_ids, "generated_token_ids": out.generated_token_ids,
                          "text": out.text, "finish_reason": out.finish_reason}))
    else:
        print(out.text)
    return 0


def _serve(args: argparse.Namespace) -> int:
    import logging
    import os

    import anyio

    from kvfence.app.api_keys import ApiKeys
    from kvfence.app.config import load_config
    from kvfence.app.discovery import parse_discovery
    from kvfence.app.server import serve
    from kvfence.app.sizing import plan_pools, resolve_context
    from kvfence.engine.attention_backend import resolve_backend_name
    from kvfence.engine.checkpoint import load_checkpoint
    from kvfence.engine.compute import confine_to_one_intra_op_thread
    from kvfence.engine.loading import checkpoint_cache, pick_device, pick_dtype
    from kvfence.engine.model_registry import resolve_model, served_name
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
    return anyio.run(serve, config, checkpoint, name, intra_op_threads)


def _worker(args: argparse.Namespace) -> int:
    import logging
    import os

    import anyio

    from kvfence.app.config import load_config
    from kvfence.app.sizing import plan_pools, resolve_context
    from kvfence.app.worker_process import check_worker_settings, run_worker
    from kvfence.engine.checkpoint import load_checkpoint
    from kvfence.engine.compute import confine_to_one_intra_op_thread
    from kvfence.engine.loading import checkpoint_cache, pick_device, pick_dtype
    from kvfence.engine.model_registry import resolve_model, served_name
    from kvfence.transports.wire.channel import split_address

    intra_op_threads = confine_to_one_intra_op_thread()
    config = load_config(vars(args), os.environ, args.config)
    logging.basicConfig(level=config.server.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    check_worker_settings(config, args.role)  # reads the secret and the front end's key: a bad file fails now
    split_address(args.control)
    path = resolve_model(config.model, kvfence_home())
    model = _read_model_config(path)  # an undersized pool fails before any weight is read
    resolve_context(config, model, plan_pools(config, model, pick_dtype(config.workers.dtype,
                                                                        pick_device(args.device)).itemsize))
    checkpoint = load_checkpoint(path, cache_dir=checkpoint_cache(kvfence_home()),
                                 keep_blocks=config.workers.weights == "native")
    name = config.served_model_name or served_name(config.model)
    return anyio.run(run_worker, config, checkpoint, name, args.role, args.device, args.control, args.advertise,
                     intra_op_threads)


def _read_model_config(path: Path) -> ModelConfig:
    """The model's architecture from its GGUF metadata or config.json alone: no weights are read."""
    from kvfence.engine import gguf_loader, hf_loader
    from kvfence.engine.checkpoint import CheckpointError
    from kvfence.engine.loading import checkpoint_cache

    if path.is_dir():
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"{path}: not a model directory (no config.json)")
        try:
            raw = json.loads(cfg_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{cfg_path}: cannot read it ({e})") from e
        return hf_loader.config_from_hf(raw, str(path))
    return gguf_loader.config_from_fields(gguf_loader.read_metadata(path, checkpoint_cache(kvfence_home())), path)


def _check(args: argparse.Namespace) -> int:
    """Print each KV pool's size against the context; 0 when every pool holds it (after
    --clamp-context, if given), 1 with the fix printed when one does not."""
    import os

    from kvfence.app.config import load_config
    from kvfence.app.sizing import UndersizedPoolError, configured_context, plan_pools, render_table, resolve_context
    from kvfence.engine.loading import pick_device, pick_dtype
    from kvfence.engine.model_registry import resolve_model

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
    from kvfence.engine.model_registry import resolve_model

    print(resolve_model(args.model, kvfence_home()))
    return 0


def _api_key(args: argparse.Namespace) -> int:
    from kvfence.app.api_keys import key_digest, new_key
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
    import os

    import httpx

    from kvfence.app.probe import Prober, ok, report, table

    prober = Prober(args.url, args.key or os.environ.get("KVFENCE_PROBE_KEY"),
                    args.other_key or os.environ.get("KVFENCE_PROBE_OTHER_KEY"), args.model,
                    context=args.context, timeout_s=args.timeout)
    try:
        checks = prober.run(progress=not args.no_progress)
    except httpx.HTTPError as e:
        print(f"kvfence probe: cannot probe {args.url}: {e}", file=sys.stderr)
        return 2
    finally:
        prober.close()
    print(json.dumps(report(args.url, checks), indent=1) if args.json else table(checks))
    return 0 if ok(checks) else 1


def _config_reference() -> int:
    from kvfence.app.config import config_reference

    print(config_reference(), end="")
    return 0


def _status(args: argparse.Namespace) -> int:
    import os

    from kvfence.app.status import status

    from kvfence.transports.core.secret import DeploymentSecret

    secret_file = args.transport_secret_file or os.environ.get("KVFENCE_TRANSPORT_SECRET_FILE")
    secret = DeploymentSecret.from_file(secret_file) if secret_file else None
    return status(args.discovery, args.front, args.admin_key or os.environ.get("KVFENCE_ADMIN_KEY"), args.json,
                  secret)


def _front_key(args: argparse.Namespace) -> int:
    """Write a fresh key pair; refuses to overwrite either file."""
    from kvfence.transports.core.front_key import FrontKey

    key = FrontKey.generate()
    key.write(args.key, args.public)
    print(f"front end key {args.key} (for --front-key-file, front ends only) and its public half {args.public} "
          f"(for --front-public-key-file, every worker); fingerprint {key.public.fingerprint}")
    return 0


# The commands that run the model: the CPU kernels they use build and switch as the environment says.
_RUNS_THE_MODEL = ("generate", "serve", "worker", "check")


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    from kvfence.engine.checkpoint import CheckpointError
    from kvfence.engine.model_registry import FetchError

    if args.command in _RUNS_THE_MODEL:
        from kvfence.app.environment import kernel_place
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
