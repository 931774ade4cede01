"""The `kvfence` command: `serve`, `check` (KV pool sizing), `generate` (offline, colocated) and `fetch`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from kvfence.app.environment import kvfence_home


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="GGUF file, Hugging Face model directory, or known name (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda:N")
    p.add_argument("--page-size", type=int, default=16, dest="page_size_tokens", help="tokens per KV page")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="paged attention and KV store: auto (triton on CUDA when installed, else torch), torch, triton")


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    """The `serve` settings (also read by `check`): None defaults, so the config file and env still apply."""
    p.add_argument("--config", type=Path, default=None, help="TOML file with these settings")
    p.add_argument("--model", default=None,
                   help="GGUF file, Hugging Face model directory, or known name (default: SmolLM2-135M-Instruct)")
    p.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default 8000)")
    p.add_argument("--dtype", default=None, help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16")
    p.add_argument("--disaggregation", choices=["on", "off"], default=None,
                   help="on: separate prefill and decode workers with a KV transport (default); off: one worker")
    p.add_argument("--transport", default=None, help="KV transport plugin (default tcp)")
    p.add_argument("--prefill-device", default=None, help="auto, cpu or cuda:N")
    p.add_argument("--decode-device", default=None, help="auto, cpu or cuda:N")
    p.add_argument("--page-size", type=int, default=None, dest="page_size_tokens", help="tokens per KV page")
    p.add_argument("--attention-backend", default=None, choices=["auto", "torch", "triton"],
                   help="paged attention and KV store: auto (triton on CUDA when installed, else torch), torch, triton")
    p.add_argument("--prefill-num-pages", type=int, default=None)
    p.add_argument("--decode-num-pages", type=int, default=None)
    p.add_argument("--prefill-kv-memory", default=None, help="prefill KV pool size, e.g. 1GiB")
    p.add_argument("--decode-kv-memory", default=None, help="decode KV pool size, e.g. 2GiB")
    p.add_argument("--max-context", type=int, default=None, help="longest prompt + completion, in tokens")
    p.add_argument("--clamp-context", action="store_const", const=True, default=None,
                   help="serve the largest context every KV pool holds instead of refusing an undersized pool")
    p.add_argument("--max-running", type=int, default=None, help="requests holding pages at once")
    p.add_argument("--max-queue", type=int, default=None, help="requests waiting for pages before 503")
    p.add_argument("--max-preemptions", type=int, default=None,
                   help="times a running request may be sent back to the queue when the decode pool runs out "
                        "before it ends with 503 (default 16)")
    p.add_argument("--chunk-tokens", type=int, default=None,
                   help="prefill tokens per step (default: 128 when prefill runs on a CPU, 512 on a GPU)")
    p.add_argument("--shutdown-timeout", type=float, default=None, dest="shutdown_timeout_s",
                   help="seconds in-flight requests get to finish after SIGTERM")
    p.add_argument("--kv-scrub", default=None, choices=["poison", "zero", "off"],
                   help="what freed KV pages are filled with (default poison: a stale read shows)")
    p.add_argument("--kv-sanitizer", action="store_const", const=True, default=None,
                   help="record which lease wrote every KV slot and fail any request that reads a slot its "
                        "lease did not write (a testing aid; costs a check over the context per step)")
    p.add_argument("--fault-inject", default=None,
                   help="testing only: inject transfer faults, e.g. 'corrupt#3,delay=0.2@0.1' (also KVFENCE_FAULTS)")
    p.add_argument("--canary-interval", type=float, default=None, dest="canary_interval_s",
                   help="seconds between readiness canaries through the real serving path (default 30)")
    p.add_argument("--queue-timeout", type=float, default=None, dest="queue_timeout_s",
                   help="seconds a request may wait for KV pages before it gets 503 (default 60)")
    p.add_argument("--transfer-timeout", type=float, default=None, dest="transfer_timeout_s",
                   help="seconds a KV transfer may take before it fails (its pages are quarantined)")
    p.add_argument("--transport-secret-file", default=None,
                   help="file holding the deployment secret the transport endpoints authenticate each other "
                        "with (at least 32 bytes; also KVFENCE_TRANSPORT_SECRET_FILE); default: a fresh secret "
                        "per process, enough when both workers live in it")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help="largest request body accepted; a longer one gets 413 (default 16 MiB)")
    p.add_argument("--stall-timeout", type=float, default=None, dest="stall_timeout_s",
                   help="seconds a streaming client may read nothing before its request is aborted (default 30)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: from --model)")
    p.add_argument("--log-level", default="info")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfence", description="Disaggregated LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate from one prompt, without a server")
    _add_model_args(gen)
    gen.add_argument("prompt", help="prompt text")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--chat", action="store_true", help="wrap PROMPT as one user message in the chat template")
    gen.add_argument("--chunk-tokens", type=int, default=512, help="prefill chunk size in tokens")
    gen.add_argument("--json", action="store_true", help="print one JSON object with ids and text")

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    _add_serve_args(srv)

    chk = sub.add_parser("check", help="check the KV pool sizes against the context, without loading weights")
    _add_serve_args(chk)

    fetch = sub.add_parser("fetch", help="fetch a known model into the cache and print its path")
    fetch.add_argument("model", nargs="?", default=None)
    return parser


def _generate(args: argparse.Namespace) -> int:
    import torch

    from kvfence.engine.chat_template import render_chat
    from kvfence.engine.kv_pool import KVPool
    from kvfence.engine.llama import LlamaModel
    from kvfence.engine.loading import load_model_spec, pick_device, pick_dtype
    from kvfence.scheduler.offline import OfflineEngine
    from kvfence.engine.runner import ModelRunner
    from kvfence.engine.sampling import SamplingParams

    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_tokens=args.max_tokens, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    checkpoint = load_model_spec(args.model, kvfence_home())
    tok = checkpoint.tokenizer
    if args.chat:
        text = render_chat(tok.chat_template, [{"role": "user", "content": args.prompt}],
                           bos_token=tok.special_token_text(tok.bos_token_id))
        prompt_ids = tok.encode(text, add_bos=False)
    else:
        prompt_ids = tok.encode(args.prompt)
    num_tokens = len(prompt_ids) + args.max_tokens
    num_pages = -(-num_tokens // args.page_size_tokens)
    model = LlamaModel(checkpoint, dtype, device, attention_backend=args.attention_backend)
    del checkpoint
    pool = KVPool(model.config, num_pages, args.page_size_tokens, dtype, device)
    engine = OfflineEngine(ModelRunner(model, pool), tok, chunk_tokens=args.chunk_tokens)
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

    from kvfence.app.config import load_config
    from kvfence.app.server import serve
    from kvfence.app.sizing import plan_pools, resolve_context
    from kvfence.engine.attention_backend import resolve_backend_name
    from kvfence.engine.checkpoint import load_checkpoint
    from kvfence.engine.compute import confine_to_one_intra_op_thread
    from kvfence.engine.loading import pick_device, pick_dtype
    from kvfence.engine.model_registry import resolve_model, served_name
    from kvfence.transports.core.secret import DeploymentSecret

    # Before any torch op here: only the devices' compute threads get intra-op threads (engine/compute.py).
    intra_op_threads = confine_to_one_intra_op_thread()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = load_config(vars(args), os.environ, args.config)
    if config.transport_secret_file:  # an unreadable or short secret fails before any weight is read
        DeploymentSecret.from_file(config.transport_secret_file)
    path = resolve_model(config.model, kvfence_home())
    # Refuse an undersized pool before reading any weights (build_workers checks again).
    model = _read_model_config(path)
    element_size = pick_dtype(config.dtype, pick_device(config.prefill_device)).itemsize
    for device in (config.prefill_device, config.decode_device):  # a bad backend fails before weights load
        resolve_backend_name(config.attention_backend, pick_device(device))
    resolve_context(config, model, plan_pools(config, model, element_size))
    checkpoint = load_checkpoint(path)
    name = args.served_model_name or served_name(config.model)
    return anyio.run(serve, config, checkpoint, name, intra_op_threads)


def _read_model_config(path: Path):  # -> ModelConfig
    """The model's architecture from its GGUF metadata or config.json alone: no weights are read."""
    from kvfence.engine import gguf_loader, hf_loader
    from kvfence.engine.checkpoint import CheckpointError

    if path.is_dir():
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"{path}: not a model directory (no config.json)")
        try:
            raw = json.loads(cfg_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{cfg_path}: cannot read it ({e})") from e
        return hf_loader.config_from_hf(raw, str(path))
    return gguf_loader.config_from_fields(gguf_loader._open(path), path)


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
    dtype = pick_dtype(config.dtype, pick_device(config.prefill_device))
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
    return 0


def _fetch(args: argparse.Namespace) -> int:
    from kvfence.engine.model_registry import resolve_model

    print(resolve_model(args.model, kvfence_home()))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    from kvfence.engine.checkpoint import CheckpointError
    from kvfence.engine.model_registry import FetchError

    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "check":
            return _check(args)
        return _fetch(args)
    except (ValueError, FileNotFoundError, CheckpointError, FetchError) as e:
        print(f"kvfence: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
