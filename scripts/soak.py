#!/usr/bin/env python
"""A bounded, seeded soak of a real kvfence server: a mix of good, bad, cancelled and stalled
requests, with faults injected into KV transfers and a canary planted per client, and a verdict.

It starts `kvfence serve` itself (on a free port, with `--fault-inject`, the KV sanitizer on, a
short stall timeout; `--server-arg` adds flags) unless `--url` names a running one. Requests are
drawn, by `--seed`, from these kinds:

  chat         a chat request of one client, streamed or not; its prompt carries the client's
               canary (a random code word); a fault injected into its transfer may fail it with
               502 kv_transfer_failed, nothing else
  near_limit   a completion whose prompt + max_tokens fill the context exactly: must succeed (a
               sequence of requests, so its bound is four times the others')
  over_long    a prompt over the context: must be 400 context_length_exceeded, before anything
  cancel       a stream the client drops: before any byte, after the first chunk, or after a few
  stalled      a stream whose client sends the request and then never reads: the server must end
               it at its stall timeout (seen at the end, in the page counts)
  oversized    a body over --max-body-bytes: must be 413
  malformed    invalid JSON, wrong types, unsupported or transfer fields: must be 400
  grammar      a chat whose output follows a JSON schema (or any JSON object): served, and what
               ends with "stop" parses and validates
  samples      a chat asking for n = 2..4 choices: served, every choice free of other canaries
  bomb         a schema built to be slow to compile (a huge repetition, the same in each of 20
               tools, nested repetitions within every shape limit): must be 400 grammar_too_complex
  dead_end     a schema no output can satisfy: must end with 400 grammar_dead_end, alone
  fan_out      n = 128 x 20 logprobs over the whole context: must be 400 response_too_large
  slow_body    a body that stops half-way: must be 408 request_timeout at the server's body timeout

When it starts the server it also gives it two tenants (an API keys file): most clients are
tenant "flood", which sends everything above at --concurrency; one more task is tenant "quiet",
which sends a short streamed chat now and then for the whole run and measures its time to first
token. A quiet request slower than --stall-bound to its first token is a stall (a failure).

At the end it checks, and prints: no response carried another client's canary; every request
ended within its bound (a hang is a failure); no 5xx answered bad input (its own fault);
no KV integrity violation; no stall of the quiet tenant; once idle, every KV page is back (in use
0 in every pool, quarantined 0, since no injected fault here leaves a write in flight); and
`/ready` is 200. Exit status 0 only when all hold.

Usage: .venv/bin/python scripts/soak.py [--requests 200] [--concurrency 16] [--seed 1] [--stall-bound 15]
           [--faults SPEC] [--url http://127.0.0.1:8000] [--server-arg=--transport=nixl --server-arg=--nixl-unauthenticated-ports-ok ...]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from local_server import MODEL, error_code, percentile, start, stop, write_keys
from soak_hostile import BODY_TIMEOUT_S, auth_header, bomb, dead_end, fan_out, slow_body

DEFAULT_FAULTS = "corrupt@0.02,truncate@0.01,drop@0.01,delay=0.3@0.03,duplicate@0.02,late_write@0.02,reorder@0.02"
STALL_TIMEOUT_S = 2.0
KINDS = {"chat": 35, "grammar": 8, "samples": 5, "near_limit": 2, "over_long": 6, "cancel": 10, "stalled": 2,
         "oversized": 3, "malformed": 13, "bomb": 5, "dead_end": 3, "fan_out": 4, "slow_body": 4}
BAD_INPUT = ("over_long", "oversized", "malformed", "bomb", "dead_end", "fan_out", "slow_body")
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["word", "n"],
          "properties": {"word": {"type": "string", "maxLength": 12}, "n": {"type": "integer", "minimum": 0}}}


@dataclass
class Outcome:
    kind: str
    status: int | None = None
    code: str | None = None
    problem: str | None = None  # a broken promise
    faulted: bool = False  # ended by an injected transfer fault, as allowed
    seconds: float = 0.0


@dataclass
class Soak:
    url: str
    rng: random.Random
    context: int
    max_body_bytes: int
    canaries: list[str]
    key: str | None = None  # the flooding tenant's API key, for the requests sent on raw sockets
    outcomes: list[Outcome] = field(default_factory=list)
    quiet_ttft: list[float] = field(default_factory=list)  # the quiet tenant's times to first token
    quiet_problems: list[str] = field(default_factory=list)

    def leaked(self, client: int, text: str) -> str | None:
        for other, canary in enumerate(self.canaries):
            if other != client and canary in text:
                return canary
        return None


def chat_body(soak: Soak, client: int, rng: random.Random, stream: bool) -> dict:
    question = rng.choice(["Repeat the code word.", "What is the code word?", "Say the code word twice.",
                           "Name a colour.", "Count to five."])
    return {"model": MODEL, "stream": stream, "max_tokens": rng.randint(4, 24), "temperature": rng.choice([0, 0.7]),
            "seed": rng.randint(0, 1000),
            "messages": [{"role": "system", "content": f"The code word of this user is {soak.canaries[client]}."},
                         {"role": "user", "content": question}]}


async def chat(soak: Soak, http: httpx.AsyncClient, rng: random.Random, out: Outcome) -> None:
    client, stream = rng.randrange(len(soak.canaries)), rng.random() < 0.6
    body = chat_body(soak, client, rng, stream)
    text = ""
    if stream:
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            out.status = r.status_code
            if r.status_code != 200:
                await r.aread()
                out.code = error_code(r)
            else:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        event = json.loads(line[6:])
                        if "error" in event:  # a failure after the stream began
                            out.code = event["error"].get("code")
                        for choice in event.get("choices", []):
                            text += choice.get("delta", {}).get("content") or ""
    else:
        r = await http.post("/v1/chat/completions", json=body)
        out.status, out.code = r.status_code, error_code(r)
        if r.status_code == 200:
            text = r.json()["choices"][0]["message"]["content"] or ""
    if (canary := soak.leaked(client, text)) is not None:
        out.problem = f"client {client} received another client's canary {canary}"
    judge_served(out)


def judge_served(out: Outcome) -> None:
    """A good request: 200, or ended by an injected fault (502 kv_transfer_failed), or turned away
    by load (503/429 with the overloaded code). Anything else is a broken promise."""
    if out.status == 200 and out.code is None:
        return
    if out.code == "kv_transfer_failed":
        out.faulted = True
    elif out.status in (429, 503) and out.code in ("overloaded", "rate_limited"):
        pass
    elif out.problem is None:
        out.problem = f"a good request ended with {out.status} {out.code}"


async def prompt_tokens(http: httpx.AsyncClient, prompt: str) -> int | None:
    """The prompt's length in tokens (a 1-token completion's usage); None when it is too long for
    the context. A 5xx (an injected transfer fault, a busy server) is asked again, up to 8 times."""
    for _ in range(8):
        r = await http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
        if r.status_code == 200:
            return r.json()["usage"]["prompt_tokens"]
        if r.status_code < 500 and r.status_code != 429:
            return None
        await asyncio.sleep(0.2)
    raise RuntimeError(f"the server kept answering {r.status_code} {error_code(r)} to a 1-token completion")


async def near_limit(soak: Soak, http: httpx.AsyncClient, rng: random.Random, out: Outcome) -> None:
    """A prompt a few tokens short of the context, with max_tokens filling it exactly: served;
    one token more: refused."""
    digit = str(rng.randint(0, 9))
    if (calibration := await prompt_tokens(http, f"{digit} " * 100)) is None:
        out.problem = "a 100-word prompt was refused as too long"
        return
    per_word = calibration / 100
    words = int((soak.context - rng.randint(4, 16)) / per_word)
    for _ in range(4):  # tokenization is close to linear here; shrink until it fits
        prompt = f"{digit} " * words
        if (n := await prompt_tokens(http, prompt)) is not None and n < soak.context:
            break
        words = int(words * 0.95)
    else:
        out.problem = "could not build a prompt within the context"
        return
    room = soak.context - n
    r = await http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": room,
                                                 "ignore_eos": True})
    out.status, out.code = r.status_code, error_code(r)
    judge_served(out)
    over = await http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": room + 1})
    if over.status_code != 400 or error_code(over) != "context_length_exceeded":
        out.problem = f"one token over the context got {over.status_code} {error_code(over)}"


async def over_long(soak: Soak, http: httpx.AsyncClient, rng: random.Random, out: Outcome) -> None:
    words = soak.context + rng.randint(1, 2000)
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "7 " * words}]}
    r = await http.post("/v1/chat/completions", json=body)
    out.status, out.code = r.status_code, error_code(r)
    if (r.status_code, out.code) != (400, "context_length_exceeded"):
        out.problem = f"an over-long prompt got {r.status_code} {out.code}"


async def cancel(soak: Soak, http: httpx.AsyncClient, rng: random.Random, out: Outcome) -> None:
    body = chat_body(soak, rng.randrange(len(soak.canaries)), rng, stream=True)
    body["max_tokens"] = 64
    after = rng.choice([0, 1, 3])  # chunks read before the client goes
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        out.status = r.status_code
        if after == 0 or r.status_code != 200:
            return  # leaves without reading the body: the connection is dropped
        seen = 0
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen >= after:
                    return


async def stalled(soak: Soak, http: httpx.AsyncClient, rng: random.Random, out: Outcome) -> None:
    body = json.dumps({"model": MODEL, "stream": True, "max_tokens": 2000, "ignore_eos": True,
                       "messages": [{"role": "user", "content": "Tell me a long story."}]}).encode()
    host, port = soak.url.removeprefix("http://").rsplit(":", 1)

    def send_and_stall() -> None:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect((host, int(port)))
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      + auth_header(soak) + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            time.sleep(STALL_TIMEOUT_S * 3)  # never reads; the server must end the request meanwhile

    await asyncio.to_thread(send_and_stall)


async def oversized(soak: Soak, http: httpx.AsyncClient, rng: random.Random, out: Outcome) -> None:
    body = b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "' \
        + b"a" * (soak.max_body_bytes + rng.randint(1, 1 << 20)) + b'"}]}'
    r = await http.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    out.status, out.code = r.status_code, error_code(r)
    if r.status_code != 413:
        out.problem = f"a body over the limit got {r.status_code} {out.code}"


MALFORMED = [
    b'{"model": "x", "messages": [',
    b'not json at all',
    json.dumps({"model": MODEL, "messages": "hello"}).encode(),
    json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}).encode(),
    json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 9}).encode(),
    json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": ["x" * 5000]}).encode(),
    json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "kv_transfer_params": {"remote_host": "10.0.0.1"}}).encode(),
    json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "bootstrap_room": 7}).encode(),
    json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}}).encode(),
    json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 500}).encode(),
    json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "echo": True}).encode(),
    json.dumps({"model": MODEL, "prompt": []}).encode(),
]


async def malformed(soak: Soak, http: httpx.AsyncClient, rng: random.Random, out: Outcome) -> None:
    body = rng.choice(MALFORMED)
    path = "/v1/completions" if b'"prompt"' in body else "/v1/chat/completions"
    r = await http.post(path, content=body, headers={"Content-Type": "application/json"})
    out.status, out.code = r.status_code, error_code(r)
    if r.status_code != 400:
        out.problem = f"malformed input {body[:60]!r} got {r.status_code} {out.code}"


async def grammar(soak: Soak, http: httpx.AsyncClient, rng: random.Random, out: Outcome) -> None:
    client = rng.randrange(len(soak.canaries))
    body = chat_body(soak, client, rng, stream=False)
    body["max_tokens"] = 48
    body["response_format"] = rng.choice([{"type": "json_object"},
                                          {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}])
    r = await http.post("/v1/chat/completions", json=body)
    out.status, out.code = r.status_code, error_code(r)
    if r.status_code == 200:
        choice = r.json()["choices"][0]
        text = choice["message"]["content"] or ""
        if (canary := soak.leaked(client, text)) is not None:
            out.problem = f"client {client} received another client's canary {canary}"
        elif choice["finish_reason"] == "stop":
            try:
                parsed = json.loads(text)
                if body["response_format"]["type"] == "json_schema" and (
                        set(parsed) != {"word", "n"} or not isinstance(parsed["n"], int)):
                    out.problem = f"an output does not follow its schema: {text[:80]!r}"
            except ValueError:
                out.problem = f"a grammar-bound output is not JSON: {text[:80]!r}"
    judge_served(out)


async def samples(soak: Soak, http: httpx.AsyncClient, rng: random.Random, out: Outcome) -> None:
    client = rng.randrange(len(soak.canaries))
    body = chat_body(soak, client, rng, stream=False)
    body["n"], body["temperature"] = rng.randint(2, 4), 0.8
    r = await http.post("/v1/chat/completions", json=body)
    out.status, out.code = r.status_code, error_code(r)
    if r.status_code == 200:
        choices = r.json()["choices"]
        if len(choices) != body["n"]:
            out.problem = f"asked for {body['n']} choices, got {len(choices)}"
        for c in choices:
            if (canary := soak.leaked(client, c["message"]["content"] or "")) is not None:
                out.problem = f"client {client} received another client's canary {canary}"
    judge_served(out)


RUNNERS = {"chat": chat, "near_limit": near_limit, "over_long": over_long, "cancel": cancel, "stalled": stalled,
           "oversized": oversized, "malformed": malformed, "grammar": grammar, "samples": samples, "bomb": bomb,
           "dead_end": dead_end, "fan_out": fan_out, "slow_body": slow_body}


async def one(soak: Soak, http: httpx.AsyncClient, kind: str, seed: int, bound_s: float) -> Outcome:
    out, t0 = Outcome(kind), time.monotonic()
    if kind == "near_limit":  # several requests in a row, two of them whole-context prefills
        bound_s *= 4
    try:
        async with asyncio.timeout(bound_s):
            await RUNNERS[kind](soak, http, random.Random(seed), out)
    except TimeoutError:
        out.problem = f"no end within {bound_s:g} s (a hang)"
    except httpx.HTTPError as e:
        if kind not in ("cancel", "oversized", "stalled"):  # these drop or get dropped on purpose
            out.problem = f"transport error: {e!r}"
    except RuntimeError as e:
        out.problem = str(e)
    out.seconds = time.monotonic() - t0
    if kind in BAD_INPUT and out.status is not None and out.status >= 500 and not out.faulted:
        out.problem = f"bad input answered with {out.status}"
    return out


ADMIN_KEY: str | None = None  # the admin key of a server started with tenants (for /metrics)


def metrics(url: str) -> dict[str, float]:
    headers = {"authorization": f"Bearer {ADMIN_KEY}"} if ADMIN_KEY else None
    text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    values = {}
    for line in text.splitlines():
        if m := re.match(r"^(kvfence_[\w]+)(\{[^}]*\})? (\S+)$", line):
            values[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return values


def pages_held(url: str) -> dict[str, float]:
    return {k: v for k, v in metrics(url).items()
            if k.startswith("kvfence_kv_pages{") and ('state="in_use"' in k or 'state="quarantined"' in k) and v}


async def quiet_probe(soak: Soak, http: httpx.AsyncClient, key: str | None) -> float | None:
    """One short streamed chat of the quiet tenant: its time to first token (None: it got none)."""
    body = {"model": MODEL, "stream": True, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": f"Name a colour. ({soak.rng.randrange(1 << 30)})"}]}
    headers = {"authorization": f"Bearer {key}"} if key else None
    t0 = time.monotonic()
    async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            code = error_code(r)
            if code not in ("kv_transfer_failed", "overloaded"):
                soak.quiet_problems.append(f"a quiet tenant's chat got {r.status_code} {code}")
            return None
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                    return time.monotonic() - t0
    return None


async def run(args: argparse.Namespace, url: str) -> int:
    rng = random.Random(args.seed)
    flood_headers = {"authorization": f"Bearer {args.flood_key}"} if args.flood_key else None
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(args.bound, connect=10),
                                 headers=flood_headers) as http:
        models = (await http.get("/v1/models")).json()
        soak = Soak(url, rng, models["data"][0].get("max_model_len", 8192), args.max_body_bytes,
                    [f"zq{rng.randrange(16**8):08x}" for _ in range(args.clients)], key=args.flood_key)
        kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=args.requests)
        queue: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
        for kind in kinds:
            queue.put_nowait((kind, rng.randrange(1 << 30)))
        solo = [t for t in [await quiet_probe(soak, http, args.quiet_key) for _ in range(10)] if t is not None]
        done = asyncio.Event()

        async def worker() -> None:
            while not queue.empty():
                kind, seed = queue.get_nowait()
                soak.outcomes.append(await one(soak, http, kind, seed, args.bound))
                if len(soak.outcomes) % 500 == 0:
                    print(f"  {len(soak.outcomes)} requests done", file=sys.stderr)

        async def quiet() -> None:
            while not done.is_set():
                try:
                    async with asyncio.timeout(args.bound):
                        ttft = await quiet_probe(soak, http, args.quiet_key)
                except (TimeoutError, httpx.HTTPError) as e:
                    soak.quiet_problems.append(f"a quiet tenant's chat failed: {e!r}")
                    ttft = None
                if ttft is not None:
                    soak.quiet_ttft.append(ttft)
                    if ttft > args.stall_bound:
                        soak.quiet_problems.append(f"the quiet tenant waited {ttft:.1f} s for a first token")
                await asyncio.sleep(1.0)

        t0 = time.monotonic()
        watcher = asyncio.create_task(quiet())
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        done.set()
        await watcher
        elapsed = time.monotonic() - t0
    beside = soak.quiet_ttft
    print(f"quiet tenant's time to first token: alone p50 {percentile(solo, 0.5):.3f} s p99 "
          f"{percentile(solo, 0.99):.3f} s ({len(solo)}); beside the flood p50 {percentile(beside, 0.5):.3f} s "
          f"p99 {percentile(beside, 0.99):.3f} s max {max(beside, default=0):.3f} s ({len(beside)})")
    return report(soak, url, elapsed)


def report(soak: Soak, url: str, elapsed: float) -> int:
    deadline = time.monotonic() + 60
    while (held := pages_held(url)) and time.monotonic() < deadline:
        time.sleep(0.2)
    ready = httpx.get(url + "/ready", timeout=10).status_code
    values = metrics(url)
    problems = [o for o in soak.outcomes if o.problem]
    violations = sum(v for k, v in values.items() if 'integrity_violations_total' in k)
    by_kind = collections.Counter(o.kind for o in soak.outcomes)
    faulted = sum(o.faulted for o in soak.outcomes)
    transfers_failed = values.get('kvfence_kv_transfers_total{result="failed"}', 0)
    print(f"requests: {len(soak.outcomes)} in {elapsed:.1f} s ({', '.join(f'{k} {n}' for k, n in by_kind.items())})")
    print(f"injected transfer faults seen by clients: {faulted}; failed transfers (server): {transfers_failed:g}")
    print(f"slowest request: {max((o.seconds for o in soak.outcomes), default=0):.1f} s")
    print(f"integrity violations: {violations:g}")
    print(f"pages still held once idle: {held or 0}")
    print(f"/ready: {ready}")
    for o in problems[:20]:
        print(f"PROBLEM [{o.kind}] {o.problem}")
    for p in soak.quiet_problems[:20]:
        print(f"PROBLEM [quiet] {p}")
    hangs = sum("a hang" in (o.problem or "") for o in problems)
    leaks = sum("canary" in (o.problem or "") for o in problems)
    count = len(problems) + len(soak.quiet_problems) + (1 if violations else 0)
    print(f"verdict: {count} problems ({hangs} hangs, {leaks} canary leaks, {len(soak.quiet_problems)} of the quiet "
          f"tenant, {violations:g} integrity violations), "
          f"{'pages at baseline' if not held else 'PAGES NOT AT BASELINE'}, ready {ready}")
    return 0 if not count and not held and ready == 200 else 1


def start_server(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str]:
    global ADMIN_KEY
    keys = log.with_name(log.name + ".keys.toml")
    made = write_keys(keys, ["flood", "quiet"], admin=True)
    args.flood_key, args.quiet_key, ADMIN_KEY = made["flood"], made["quiet"], made["admin"]
    return start(["--kv-sanitizer", "--fault-inject", args.faults, "--transfer-timeout", "3", "--stall-timeout",
                  str(STALL_TIMEOUT_S), "--max-body-bytes", str(args.max_body_bytes), "--canary-interval", "5",
                  "--max-context", str(args.max_context), "--body-timeout", str(BODY_TIMEOUT_S),
                  "--api-keys", str(keys), *args.server_arg], log)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--clients", type=int, default=8, help="clients, each with its own canary")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--faults", default=DEFAULT_FAULTS, help="the --fault-inject plan of the server")
    parser.add_argument("--bound", type=float, default=90.0, help="seconds any one request may take")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20)
    parser.add_argument("--max-context", type=int, default=1024,
                        help="the server's context (small, so near-limit and over-long requests stay cheap)")
    parser.add_argument("--url", default=None, help="a running server instead of starting one")
    parser.add_argument("--server-arg", action="append", default=[], help="extra flag for kvfence serve")
    parser.add_argument("--log", type=Path, default=Path("soak-server.log"))
    parser.add_argument("--stall-bound", type=float, default=15.0,
                        help="seconds the quiet tenant may wait for a first token beside the flood")
    parser.add_argument("--flood-key", default=None, help="with --url: the API key of the flooding tenant")
    parser.add_argument("--quiet-key", default=None, help="with --url: the API key of the quiet tenant")
    args = parser.parse_args()
    if args.url:
        return asyncio.run(run(args, args.url))
    proc, url = start_server(args, args.log)
    try:
        return asyncio.run(run(args, url))
    finally:
        stop(proc)


if __name__ == "__main__":
    sys.exit(main())
