"""Compiling requests' grammars for the front end: never on the event loop or a compute thread,
never for longer than a budget, and kept per tenant.

A grammar (engine/grammar.py) that passed the shape limits (app/api/grammar_bounds.py) is first
compiled by a probe: a process of its own, which is killed when it runs past `budget_s`; the
request then gets 400 `grammar_too_complex` and nothing else waited for it. What the probe
compiled within the budget is compiled once more in a thread of this process (xgrammar releases
the GIL while it compiles; the probe bounds how long that takes), because a compiled grammar
cannot leave the process cheaply: its serialized form is often hundreds of times its size (186 MB
for 1,000 required properties). The result is a `Compiled` that in-process workers find by its key
(engine/grammar.py), so they never compile.

Results are kept per tenant (the key names the tenant): a tenant never learns from a fast answer
that another one compiled the same schema. At most `max_waiting` compiles wait for a probe at
once; past that a request gets 503 with Retry-After. A probe that was killed is replaced in the
background (forked from a server that has the library loaded: about 40 ms), so the request that
ran over the budget gets its answer at once and the next finds a probe ready.
"""

from __future__ import annotations

import collections
import logging
import multiprocessing
import signal
import queue
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import anyio

from kvfence.engine.grammar import Compiled, compile_spec, grammar_key, new_compiler, tokenizer_info
from kvfence.engine.tokenizer import Tokenizer
from kvfence.scheduler.core.errors import RequestError, overloaded

log = logging.getLogger(__name__)

DEFAULT_BUDGET_S = 0.75  # a schema's compile takes ~5 ms; the 400 of a bomb comes within a second
DEFAULT_PROBES = 2
MAX_WAITING = 64
CACHE_BYTES = 256 << 20  # compiled grammars kept, over every tenant (their in-memory size)
_START_TIMEOUT_S = 60.0  # a probe process that is not ready by then has failed to start


def _probe_main(conn: Connection, vocab: list[bytes], vocab_size: int, stop_ids: list[int]) -> None:
    """A probe process: compile each spec it is sent, answer ("ok", "") or ("error", why). It ends
    when the server closes its connection or kills it; a Ctrl-C at the terminal, which reaches the
    whole process group, is the server's to act on."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import xgrammar as xgr

    compiler = new_compiler(xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=vocab_size,
                                              stop_token_ids=stop_ids))
    conn.send(("ready", ""))
    while True:
        try:
            spec = conn.recv()
        except (EOFError, ConnectionError):  # the server closed it, or went away
            return
        try:
            compile_spec(compiler, spec)
            conn.send(("ok", ""))
        except ValueError as e:
            conn.send(("error", str(e)))


def _context() -> Any:
    """Where probe processes come from: a fork server (started on first use, itself a fresh
    process: this one runs threads and is never forked) that has imported xgrammar and this module
    once, so a probe killed past its budget is replaced in about 40 ms, not the 2 s of a fresh
    interpreter importing them (a stream of bombs would otherwise find every probe restarting)."""
    ctx = multiprocessing.get_context("forkserver")
    # xgrammar (engine/grammar.py imports it only where used), and the server's entry point: a
    # child runs its main module again, and finds it imported
    ctx.set_forkserver_preload(["xgrammar", "__main__", "kvfence.app.cli", __name__])
    return ctx


class _Probe:
    """One probe process and its end of the pipe; `run` may kill it (then `alive` is False)."""

    def __init__(self, args: tuple[list[bytes], int, list[int]]) -> None:
        self._args = args
        self._process: Any = None
        self._conn: Connection | None = None

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def start(self) -> None:
        ctx = _context()
        parent, child = ctx.Pipe()
        process = ctx.Process(target=_probe_main, args=(child, *self._args), name="kvfence-grammar-probe",
                              daemon=True)
        process.start()
        child.close()
        try:
            ready = parent.poll(_START_TIMEOUT_S) and parent.recv()[0] == "ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            process.kill()
            process.join()
            parent.close()
            raise RuntimeError("a grammar probe process did not start")
        self._process, self._conn = process, parent

    def run(self, spec: str, budget_s: float) -> tuple[str, str]:
        """("ok", ""), ("error", why), or ("timeout", "") after killing the process."""
        assert self._conn is not None
        try:
            self._conn.send(spec)
            if self._conn.poll(budget_s):
                kind, why = self._conn.recv()
                return str(kind), str(why)
            verdict = ("timeout", "")
        except (EOFError, OSError):  # it died on this spec
            verdict = ("error", "the grammar compiler failed on this schema")
        self.kill()
        return verdict

    def kill(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join()
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None


class GrammarCompiler:
    """The front end's compiler of grammars for one model's vocabulary (`vocab_size` logits wide)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, *, budget_s: float = DEFAULT_BUDGET_S,
                 probes: int = DEFAULT_PROBES, max_waiting: int = MAX_WAITING, cache_bytes: int = CACHE_BYTES) -> None:
        if budget_s <= 0 or probes < 1 or max_waiting < 1:
            raise ValueError(f"budget_s must be > 0, probes and max_waiting >= 1; got {budget_s}, {probes}, "
                             f"{max_waiting}")
        self.budget_s, self.max_waiting, self.cache_bytes = budget_s, max_waiting, cache_bytes
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._compiler: Any = None  # this process's, made on first use
        self._idle: queue.Queue[_Probe] = queue.Queue()
        self._probes: list[_Probe] = []
        self._probe_count = probes
        self._lock = threading.Lock()
        self._waiting = 0
        self._closed = False
        self._threads = anyio.CapacityLimiter(max_waiting + 1)  # every waiting compile holds a thread
        self._cache: collections.OrderedDict[str, Compiled] = collections.OrderedDict()
        self._cached_bytes = 0
        self.compiled = self.refused = self.over_budget = 0  # counts, for tests and metrics

    async def compile(self, tenant: str, spec: str, param: str) -> Compiled:
        """The compiled grammar of `spec` for `tenant`, or RequestError: 400 `grammar_too_complex`
        (over the budget) or `invalid_value` (it cannot be compiled), naming `param`; 503 when
        `max_waiting` compiles wait already."""
        key = grammar_key(spec, tenant)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        if self._waiting >= self.max_waiting:
            raise overloaded(f"{self._waiting} grammars are waiting to be compiled; retry shortly")
        self._waiting += 1
        try:
            verdict, why = await anyio.to_thread.run_sync(self._probe, spec, limiter=self._threads)
            if verdict == "timeout":
                self.over_budget += 1
                log.warning("a grammar of tenant %s ran past its %.1f s compile budget; refused", tenant,
                            self.budget_s)
                raise RequestError(400, "grammar_too_complex", f"compiling this schema took longer than "
                                   f"{self.budget_s:g} s, the most this server allows; simplify it (fewer "
                                   "alternatives, shorter repetitions)", param=param)
            if verdict == "error":
                self.refused += 1
                raise RequestError(400, "invalid_value", f"the JSON schema cannot be used: {why}", param=param)
            grammar = await anyio.to_thread.run_sync(self._compile_here, spec, limiter=self._threads)
        finally:
            self._waiting -= 1
        self.compiled += 1
        compiled = Compiled(key, grammar)
        self._keep(compiled)
        return compiled

    def _keep(self, compiled: Compiled) -> None:
        old = self._cache.pop(compiled.key, None)
        if old is not None:
            self._cached_bytes -= old.size_bytes
        self._cache[compiled.key] = compiled
        self._cached_bytes += compiled.size_bytes
        while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
            _, dropped = self._cache.popitem(last=False)
            self._cached_bytes -= dropped.size_bytes

    def _compile_here(self, spec: str) -> Any:
        with self._lock:
            if self._compiler is None:
                self._compiler = new_compiler(tokenizer_info(self._tokenizer, self._vocab_size))
        return compile_spec(self._compiler, spec)

    def _probe(self, spec: str) -> tuple[str, str]:
        """In a thread: wait for an idle probe, run `spec` through it (replacing it in the
        background when it had to be killed)."""
        self._start_probes()
        probe = self._idle.get()
        if not probe.alive:  # closed meanwhile
            self._idle.put(probe)
            return "error", "the server is shutting down"
        try:
            return probe.run(spec, self.budget_s)
        finally:
            if probe.alive:
                self._idle.put(probe)
            else:
                threading.Thread(target=self._revive, args=(probe,), name="kvfence-grammar-probe-start",
                                 daemon=True).start()

    def _start_probes(self) -> None:
        with self._lock:
            missing = self._probe_count - len(self._probes)
            if missing <= 0:
                return
            tokenizer = self._tokenizer
            args = ([tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)], self._vocab_size,
                    sorted(tokenizer.eos_token_ids))
            fresh = [_Probe(args) for _ in range(missing)]
            self._probes += fresh
        for probe in fresh:
            self._revive(probe)

    def _revive(self, probe: _Probe) -> None:
        while not self._closed:
            try:
                probe.start()
                break
            except Exception:
                if self._closed:  # shutting down meanwhile: nothing to report
                    break
                log.exception("starting a grammar probe failed; trying again in a second")
                time.sleep(1.0)
        if self._closed:
            probe.kill()
        self._idle.put(probe)

    def start(self) -> None:
        """Start the probe processes in the background (else the first grammar starts them)."""
        threading.Thread(target=self._start_probes, name="kvfence-grammar-probes", daemon=True).start()

    def close(self) -> None:
        """Stop every probe process; a probe being started is stopped once it is up."""
        self._closed = True
        for probe in self._probes:
            probe.kill()
