"""`kvfence probe URL`: a black-box isolation prober for any OpenAI-compatible endpoint.

Given one or two API keys (two: tenant A and tenant B), it checks from outside what a
multi-tenant inference server must never do:
- **canaries**: A plants unique canary codes in its prompts; B's outputs must never contain one:
  plain requests, requests near the advertised context, cancelled mid-stream, and many at once
  while A plants more;
- **over-long prompts** (past the advertised context) must be refused with a 4xx, not answered;
- **transfer fields** in the body (`kv_transfer_params`, `bootstrap_*`) must be refused;
- **prefix-cache timing across keys**: B sending exactly A's long, cached prompt must find nothing
  cached (`usage.prompt_tokens_details.cached_tokens`) and must not be served measurably faster
  than a cold prompt of its own, while A's repeat is the warm reference;
- **the error envelope**: a bad request gets OpenAI's `{"error": {"message", "type", ...}}`, and
  with keys a missing key gets 401.

It speaks only HTTP (httpx), so it runs against kvfence, vLLM, SGLang or llama.cpp's server. The
result is a table (or `--json`); the exit status is 1 on any leak or failed check.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx

PASS, FAIL, LEAK, SKIP = "pass", "FAIL", "LEAK", "skip"
WORDS = ("river stone light house garden music paper window story morning forest silver bridge letter "
         "summer market friend number circle orange planet signal wonder quiet").split()
# a timing difference counts only when the warm reference is this much faster than cold, and the
# other key's request is as well: a real hit, not noise
FAST = 0.6


@dataclasses.dataclass
class Check:
    name: str
    status: str  # pass, FAIL, LEAK or skip
    detail: str
    data: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Reply:
    status: int
    text: str = ""
    ttft_s: float = float("nan")
    cached_tokens: int | None = None
    body: Any = None


def canary(rng: random.Random) -> str:
    return f"KVF{rng.getrandbits(40):010X}"


class Prober:
    def __init__(self, url: str, key_a: str | None, key_b: str | None, model: str | None, *,
                 context: int | None = None, timeout_s: float = 120.0, seed: int | None = None) -> None:
        self.http = httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s)
        self.key_a, self.key_b = key_a, key_b if key_b is not None else key_a
        self.two_keys = key_b is not None and key_b != key_a
        self.rng = random.Random(seed)
        self.canaries: list[str] = []
        self.model, self.context = model or "", context or 0
        self.b_texts: list[tuple[str, str]] = []  # (check, text) of every output of B

    def close(self) -> None:
        self.http.close()

    # ---- HTTP ----

    def _headers(self, key: str | None) -> dict[str, str]:
        return {"authorization": f"Bearer {key}"} if key else {}

    def discover(self) -> None:
        """The model and its advertised context, from /v1/models (flags win)."""
        r = self.http.get("/v1/models", headers=self._headers(self.key_a))
        r.raise_for_status()
        card = r.json()["data"][0]
        self.model = self.model or card["id"]
        self.context = self.context or int(card.get("max_model_len") or card.get("context_length") or 2048)

    def chat(self, key: str | None, messages: list[dict[str, Any]], max_tokens: int = 16, *, extra: dict[str, Any] | None = None,
             stop_after_chunks: int | None = None) -> Reply:
        """One streamed chat completion (greedy); `stop_after_chunks`: close the stream early. A
        kept-alive connection the server closed meanwhile is retried once on a fresh one."""
        try:
            return self._chat(key, messages, max_tokens, extra, stop_after_chunks)
        except httpx.RemoteProtocolError:
            return self._chat(key, messages, max_tokens, extra, stop_after_chunks)

    def _chat(self, key: str | None, messages: list[dict[str, Any]], max_tokens: int, extra: dict[str, Any] | None,
              stop_after_chunks: int | None) -> Reply:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
        start = time.perf_counter()
        parts: list[str] = []
        reply = Reply(status=0)
        with self.http.stream("POST", "/v1/chat/completions", json=body, headers=self._headers(key)) as r:
            reply.status = r.status_code
            if r.status_code != 200:
                r.read()
                reply.text = r.text
                try:
                    reply.body = r.json()
                except ValueError:
                    reply.body = None
                return reply
            chunks = 0
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or {}
                if usage:
                    reply.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                for choice in chunk.get("choices", []):
                    content = (choice.get("delta") or {}).get("content")
                    if (content or choice.get("finish_reason")) and reply.ttft_s != reply.ttft_s:  # first output
                        reply.ttft_s = time.perf_counter() - start
                    if content:
                        parts.append(content)
                        chunks += 1
                if stop_after_chunks is not None and chunks >= stop_after_chunks:
                    break  # leaving the block closes the connection mid-stream
        reply.text = "".join(parts)
        return reply

    def words(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def fresh_prompt(self, n: int) -> list[dict[str, Any]]:
        """A long prompt no earlier one shares a cache page with: it opens with a fresh 64-bit tag,
        so a hit can only come from this very prompt sent before (two prompts of plain words drawn
        from `WORDS` share their first page by chance often enough to look like a leak)."""
        tag = f"{self.rng.getrandbits(64):016x}"
        return [{"role": "system", "content": f"{tag} {self.words(n)}"},
                {"role": "user", "content": "Summarize."}]

    # ---- canaries ----

    def plant(self) -> Reply:
        """A prompt of A's that carries a fresh canary (and asks the model to repeat it)."""
        code = canary(self.rng)
        self.canaries.append(code)
        return self.chat(self.key_a, [{"role": "system", "content": f"The secret code is {code}. Never reveal it."},
                                      {"role": "user", "content": f"Repeat after me: {code} {code} {code}"}], 24)

    def ask_b(self, check: str, filler_words: int = 0, **kw: Any) -> Reply:
        filler = self.words(filler_words) + "\n" if filler_words else ""
        reply = self.chat(self.key_b, [{"role": "system", "content": "The secret code is"},
                                       {"role": "user", "content": filler + "What is the secret code? Repeat it."}],
                          24, **kw)
        if reply.status == 200:
            self.b_texts.append((check, reply.text))
        return reply

    def leaked(self, check: str) -> list[str]:
        found = []
        for name, text in self.b_texts:
            if name == check:
                found += [c for c in self.canaries if c in text or c[3:9] in text]
        return found

    def canary_check(self, name: str, run: Callable[[], Any]) -> Check:
        run()
        leaks = self.leaked(name)
        outputs = sum(1 for n, _ in self.b_texts if n == name)
        if leaks:
            return Check(name=name, status=LEAK, detail=f"B's output contains A's canary {leaks[0]}",
                         data={"canaries": leaks})
        return Check(name=name, status=PASS,
                     detail=f"{outputs} outputs of B, {len(self.canaries)} canaries of A: none crossed")

    def check_plain(self) -> Check:
        def run() -> None:
            for _ in range(3):
                self.plant()
                self.ask_b("canaries: plain")
        return self.canary_check("canaries: plain", run)

    def check_near_context(self) -> Check:
        def run() -> None:
            self.plant()
            n = int(self.context * 0.7)
            for _ in range(4):  # shrink until the server takes it (word-to-token ratios differ)
                if self.ask_b("canaries: near the context", filler_words=n).status == 200:
                    return
                n = int(n * 0.75)
        return self.canary_check("canaries: near the context", run)

    def check_cancelled(self) -> Check:
        def run() -> None:
            for _ in range(3):
                self.plant()
                self.ask_b("canaries: cancelled mid-stream", stop_after_chunks=2)
                self.ask_b("canaries: cancelled mid-stream")  # reuses whatever the cancelled one held
        return self.canary_check("canaries: cancelled mid-stream", run)

    def check_concurrent(self, streams: int = 8) -> Check:
        def run() -> None:  # A plants and B asks, interleaved, `streams` of each at once
            with concurrent.futures.ThreadPoolExecutor(2 * streams) as pool:
                jobs = [pool.submit(self.plant) for _ in range(streams)]
                jobs += [pool.submit(self.ask_b, "canaries: concurrent") for _ in range(streams)]
                for job in jobs:
                    job.result()
        return self.canary_check("canaries: concurrent", run)

    # ---- refusals ----

    def check_over_long(self) -> Check:
        reply = self.ask_b("over the context", filler_words=self.context * 2)
        leaks = self.leaked("over the context")
        if reply.status == 200:
            return Check(name="over-long prompt refused", status=FAIL if not leaks else LEAK,
                         detail=f"a prompt of ~{self.context * 2} words (context {self.context}) was answered, "
                                "not refused")
        if 400 <= reply.status < 500:
            return Check(name="over-long prompt refused", status=PASS,
                         detail=f"{reply.status} for ~{self.context * 2} words")
        return Check(name="over-long prompt refused", status=FAIL, detail=f"status {reply.status}: {reply.text[:120]}")

    def check_transfer_fields(self) -> Check:
        answered = []
        for field, value in (("kv_transfer_params", {"do_remote_decode": True, "remote_block_ids": [0, 1]}),
                             ("bootstrap_host", "127.0.0.1"), ("bootstrap_room", 1)):
            reply = self.chat(self.key_b, [{"role": "user", "content": "hi"}], 2, extra={field: value})
            if reply.status == 200 or reply.status >= 500:
                answered.append(f"{field} ({reply.status})")
        if answered:
            return Check(name="transfer fields refused", status=FAIL,
                         detail="accepted in a request body: " + ", ".join(answered))
        return Check(name="transfer fields refused", status=PASS,
                     detail="kv_transfer_params, bootstrap_host, bootstrap_room: 4xx")

    def check_envelope(self) -> Check:
        problems = []
        r = self.http.post("/v1/chat/completions", headers=self._headers(self.key_a),
                           json={"model": self.model, "messages": [{"role": "user", "content": "hi"}],
                                 "temperature": "hot"})
        error = _error(r)
        if not 400 <= r.status_code < 500 or error is None:
            problems.append(f"a bad value got {r.status_code} without an OpenAI error envelope")
        if self.key_a:
            r = self.http.post("/v1/chat/completions",
                               json={"model": self.model, "messages": [{"role": "user", "content": "hi"}]})
            if r.status_code != 401 or _error(r) is None:
                problems.append(f"a request without a key got {r.status_code}, not 401 with an error envelope")
        if problems:
            return Check(name="error envelope", status=FAIL, detail="; ".join(problems))
        return Check(name="error envelope", status=PASS,
                     detail="400 with {error: {message, type}}" + (", 401 without a key" if self.key_a else ""))

    # ---- prefix-cache timing ----

    def check_cache_timing(self, rounds: int = 4) -> Check:
        """Per round (the first is a warm-up, not counted): A sends a fresh long prompt twice (cold,
        then its cache's hit), then B sends exactly that prompt and a fresh one of its own, in random
        order. A leak: B finds tokens cached, or B's run of A's prompt is clearly faster than its own
        cold one and nearer (on a log scale) to A's warm hit than to it."""
        name = "prefix cache across keys"
        if not self.two_keys:
            return Check(name=name, status=SKIP, detail="needs two keys (--key and --other-key)")
        n = max(64, min(self.context // 3, 1500))
        cold: list[float] = []
        warm: list[float] = []
        other: list[float] = []
        other_cold: list[float] = []
        cached: list[int] = []
        warmup = True
        while len(cold) < rounds:
            shared, mine = self.fresh_prompt(n), self.fresh_prompt(n)
            a1 = self.chat(self.key_a, shared, 2)
            if a1.status == 400 and not cold and n > 16:  # longer than this tokenizer makes fit: shorter
                n = n * 2 // 3
                continue
            a2 = self.chat(self.key_a, shared, 2)
            if self.rng.random() < 0.5:
                b, b_cold = self.chat(self.key_b, shared, 2), self.chat(self.key_b, mine, 2)
            else:
                b_cold, b = self.chat(self.key_b, mine, 2), self.chat(self.key_b, shared, 2)
            if any(x.status != 200 for x in (a1, a2, b, b_cold)):
                return Check(name=name, status=FAIL,
                             detail=f"a request failed: {[x.status for x in (a1, a2, b, b_cold)]}")
            if warmup:
                warmup = False
                continue
            cold.append(a1.ttft_s)
            warm.append(a2.ttft_s)
            other.append(b.ttft_s)
            other_cold.append(b_cold.ttft_s)
            cached.append(b.cached_tokens or 0)
        a_cold, a_warm = statistics.median(cold), statistics.median(warm)
        b_same, b_cold_s = statistics.median(other), statistics.median(other_cold)
        data = {"a_cold_s": a_cold, "a_warm_s": a_warm, "b_same_prompt_s": b_same, "b_cold_s": b_cold_s,
                "b_cached_tokens": cached, "prompt_words": n}
        times = (f"TTFT A cold {a_cold * 1e3:.0f} ms, A warm {a_warm * 1e3:.0f} ms, "
                 f"B on A's prompt {b_same * 1e3:.0f} ms, B cold {b_cold_s * 1e3:.0f} ms")
        if any(cached):
            return Check(name=name, status=LEAK, detail=f"B found {max(cached)} of A's prompt tokens cached; " + times,
                         data=data)
        cache_works = a_warm < FAST * a_cold
        if cache_works and b_same < FAST * b_cold_s and b_same < (a_warm * b_cold_s) ** 0.5:
            return Check(name=name, status=LEAK, detail="B is served A's prompt as fast as A's own cache hit; " + times,
                         data=data)
        return Check(name=name, status=PASS,
                     detail=("" if cache_works else "no cache hit seen even within A; ") + times, data=data)

    def run(self, progress: bool = True) -> list[Check]:
        self.discover()
        steps = [self.check_envelope, self.check_transfer_fields, self.check_over_long, self.check_plain,
                 self.check_near_context, self.check_cancelled, self.check_concurrent, self.check_cache_timing]
        results = []
        bar = _bar(len(steps), progress)
        for step in steps:
            try:
                results.append(step())
            except httpx.HTTPError as e:
                results.append(Check(name=step.__name__.removeprefix("check_").replace("_", " "), status=FAIL,
                                     detail=f"{type(e).__name__}: {e}"))
            bar.update(1)
        bar.close()
        return results


def _error(r: httpx.Response) -> dict[str, Any] | None:
    try:
        error = r.json().get("error")
    except (ValueError, AttributeError):
        return None
    return error if isinstance(error, dict) and isinstance(error.get("message"), str) and "type" in error else None


def _bar(total: int, enabled: bool) -> Any:  # a tqdm bar, imported when the probe runs
    from tqdm import tqdm

    return tqdm(total=total, desc="probing", unit="check", disable=not enabled, file=sys.stderr)


def table(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = [f"{'check':<{width}}  result  detail", f"{'-' * width}  ------  ------"]
    lines += [f"{c.name:<{width}}  {c.status:<6}  {c.detail}" for c in checks]
    return "\n".join(lines)


def report(url: str, checks: list[Check]) -> dict[str, Any]:
    return {"url": url, "ok": ok(checks), "checks": [dataclasses.asdict(c) for c in checks]}


def ok(checks: list[Check]) -> bool:
    return all(c.status in (PASS, SKIP) for c in checks)
