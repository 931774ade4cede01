"""Per-token cost of a JSON-schema grammar with each well-kept grammar library, on this CPU.

For xgrammar, llguidance and outlines-core: the time to compile a JSON schema for the default
model's vocabulary (49,152 tokens), and the time per output token to compute the allowed-token
mask and advance the matcher, while following the tokens of a valid instance (what constrained
decoding does once per token per request). Run it with the three installed
(`pip install xgrammar llguidance outlines-core`); it prints one table.

    .venv/bin/python scripts/bench_grammar.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvfence.app.config.environment import kvfence_home
from kvfence.engine.checkpoint import load_checkpoint
from kvfence.engine.known_models import resolve_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines", "poetry"],
            "address": {"city": "London", "zip": "W1"}}


def bench_xgrammar(tok, ids: list[int], eos: int) -> tuple[float, list[float]]:
    import xgrammar as xgr

    vocab = [tok.token_bytes(i) for i in range(tok.vocab_size)]
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=tok.vocab_size, stop_token_ids=[eos])
    t0 = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"), strict_mode=True)
    compile_s = time.perf_counter() - t0
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, tok.vocab_size)
    per: list[float] = []
    for t in ids:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        ok = matcher.accept_token(t)
        per.append(time.perf_counter() - t0)
        assert ok, f"xgrammar refused token {t}"
    return compile_s, per


def bench_llguidance(tok, ids: list[int], eos: int) -> tuple[float, list[float]]:
    import llguidance
    import llguidance.torch

    lltok = llguidance.LLTokenizer(tok.inner.to_str(), n_vocab=tok.vocab_size, eos_token=eos)
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA),
                                                            defaults={"whitespace_flexible": False})
    matcher = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - t0
    assert not matcher.is_error(), matcher.get_error()
    mask = llguidance.torch.allocate_token_bitmask(1, tok.vocab_size)
    per: list[float] = []
    for t in ids:
        t0 = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
        ok = matcher.consume_token(t)
        per.append(time.perf_counter() - t0)
        assert ok, f"llguidance refused token {t}: {matcher.get_error()}"
    return compile_s, per


def bench_outlines(tok, ids: list[int], eos: int) -> tuple[float, list[float]]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    pieces: dict[str, list[int]] = {}
    for i in range(tok.vocab_size):
        if i == eos:
            continue
        pieces.setdefault(tok.inner.id_to_token(i), []).append(i)
    t0 = time.perf_counter()
    vocabulary = Vocabulary(eos, pieces)
    index = Index(build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern=""), vocabulary)
    compile_s = time.perf_counter() - t0
    guide = Guide(index)
    mask = torch.zeros((tok.vocab_size + 31) // 32, dtype=torch.int32)
    per: list[float] = []
    for t in ids:
        t0 = time.perf_counter()
        guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
        guide.advance(t)
        per.append(time.perf_counter() - t0)
    return compile_s, per


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    tok = load_checkpoint(resolve_model(None, kvfence_home(), progress=False), weights=False).tokenizer
    ids = tok.encode(json.dumps(INSTANCE, separators=(",", ":")))
    eos = 2
    print(f"schema of {len(SCHEMA['properties'])} properties; a valid instance of {len(ids)} tokens; "
          f"vocabulary {tok.vocab_size}; torch threads {torch.get_num_threads()}")
    print(f"{'library':<14}{'compile ms':>12}{'mask+advance us/token p50':>28}{'p99':>10}{'mean':>10}")
    for name, bench in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance),
                        ("outlines-core", bench_outlines)):
        try:
            runs = [bench(tok, ids, eos) for _ in range(args.repeat)]
        except Exception as e:  # a library missing or refusing: say so, measure the others
            print(f"{name:<14} failed: {type(e).__name__}: {e}")
            continue
        compile_ms = statistics.median(r[0] for r in runs) * 1e3
        per = sorted(x * 1e6 for r in runs for x in r[1])
        print(f"{name:<14}{compile_ms:>12.1f}{per[len(per) // 2]:>28.1f}{per[int(len(per) * 0.99)]:>10.1f}"
              f"{statistics.mean(per):>10.1f}")


if __name__ == "__main__":
    main()
