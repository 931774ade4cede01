#!/usr/bin/env python
"""Greedy references for Gemma 3 270M from an independent engine: llama.cpp, as vendored in the
llama-cpp-python sdist (built once by scripts/bench_peer.py's recipe), serving an F32 copy of the
model's own GGUF (made by its `llama-quantize`) with an f32 KV cache, one slot, no prompt cache.

  .venv/bin/python scripts/gemma3_references.py            # writes tests/data/gemma3_greedy.json

Every prompt's token ids come from llama.cpp's own tokenizer (`/tokenize`, special tokens
parsed); kvfence's tests check that its tokenizer gives the same ids for the same text, then that
its greedy tokens equal these. The prompts: completions (raw text after BOS) and chats in Gemma's
turn format (`<start_of_turn>user\\n...<end_of_turn>\\n<start_of_turn>model\\n` after BOS; the base
model's GGUF carries no chat template), short ones and ones over 1,000 tokens, so that the
512-token sliding window of five layers in six decides what they attend to. Each case: the
first OUTPUT_TOKENS greedy ids (temperature 0, top-k 1; end of turn not treated as a stop).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvfence.app.config.environment import kvfence_home
from kvfence.engine.known_models import GEMMA3_270M, resolve_model, sha256_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peer import PEER_SDIST, peer_build, peer_model  # noqa: E402
from bench_remote import free_port  # noqa: E402

OUTPUT_TOKENS = 32
CONTEXT = 4096
OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "gemma3_greedy.json"


def chat(*turns: tuple[str, str]) -> str:
    """Gemma's turn format, ending with the model's turn opened (the generation prompt)."""
    text = "".join(f"<start_of_turn>{role}\n{content}<end_of_turn>\n" for role, content in turns)
    return "<bos>" + text + "<start_of_turn>model\n"


def long_text(sections: int) -> str:
    """A long, plain, deterministic text: a travel log whose sections name distinct places and
    numbers, so that what lies more than 512 tokens back is different from what is near."""
    places = ["Lisbon", "Porto", "Seville", "Granada", "Valencia", "Barcelona", "Marseille", "Lyon", "Geneva",
              "Turin", "Milan", "Verona", "Venice", "Trieste", "Ljubljana", "Zagreb", "Budapest", "Vienna",
              "Prague", "Dresden", "Leipzig", "Berlin", "Hamburg", "Copenhagen", "Malmo", "Gothenburg", "Oslo"]
    out = []
    for i in range(sections):
        place = places[i % len(places)]
        out.append(f"Day {i + 1}. We reached {place} after {3 + i % 7} hours on the road. The weather was "
                   f"{['clear', 'rainy', 'windy', 'foggy', 'warm'][i % 5]}, and we spent {20 + 3 * i} euros on "
                   f"food. In the evening we walked along the main street of {place}, counted {12 + i} bridges "
                   f"and wrote down the name of the oldest building we saw.")
    return " ".join(out)


CASES: list[tuple[str, str, str]] = [  # (id, kind, text as llama.cpp tokenizes it)
    ("completion_fox", "completion", "<bos>The quick brown fox"),
    ("completion_capitals", "completion", "<bos>The capital of France is Paris. The capital of Italy is"),
    ("completion_code", "completion", "<bos>def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
    ("chat_factual", "chat", chat(("user", "What is the boiling point of water at sea level in degrees Celsius?"))),
    ("chat_two_turns", "chat", chat(("user", "Name a primary colour."), ("model", "Red."),
                                    ("user", "Name another one."))),
    ("completion_long_1100", "completion", "<bos>" + long_text(22) + " On the last day we reached"),
    ("chat_long_1500", "chat", chat(("user", long_text(30) + "\n\nIn which city did we spend the first day?"))),
    ("completion_long_2500", "completion", "<bos>" + long_text(50) + " Looking back, the first city was"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    home = kvfence_home()
    model = resolve_model(GEMMA3_270M.name, home)
    bin_dir = peer_build(home)
    f32 = peer_model(bin_dir, model, "float32")
    port = free_port()
    log = Path("/tmp") / f"gemma3-references-{port}.log"
    cmd = [str(bin_dir / "llama-server"), "-m", str(f32), "--host", "127.0.0.1", "--port", str(port),
           "-c", str(CONTEXT), "-np", "1", "--cache-type-k", "f32", "--cache-type-v", "f32", "--no-cache-prompt",
           "--cache-ram", "0", "--swa-full", "--temp", "0", "--top-k", "1", "-t", "2"]
    with open(log, "w") as out:
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=600) as client:
            for _ in range(300):
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(1)
            cases = []
            for case_id, kind, text in CASES:
                ids = client.post("/tokenize", json={"content": text, "add_special": False,
                                                     "parse_special": True}).json()["tokens"]
                done = client.post("/completion", json={
                    "prompt": ids, "n_predict": OUTPUT_TOKENS, "temperature": 0, "top_k": 1, "ignore_eos": True,
                    "cache_prompt": False, "return_tokens": True, "samplers": ["top_k"]}).json()
                greedy = done["tokens"]
                assert len(greedy) == OUTPUT_TOKENS, (case_id, done)
                cases.append({"id": case_id, "kind": kind, "text": text, "prompt_token_ids": ids,
                              "num_prompt_tokens": len(ids), "greedy_ids": greedy, "greedy_text": done["content"]})
                print(f"{case_id}: {len(ids)} prompt tokens -> {done['content'][:60]!r}", flush=True)
            version = subprocess.run([str(bin_dir / "llama-server"), "--version"], capture_output=True,
                                     text=True).stderr.strip().splitlines()[-2:]
    finally:
        server.terminate()
        server.wait(30)
    args.out.write_text(json.dumps({
        "model": f"{GEMMA3_270M.name} ({GEMMA3_270M.filename}), converted to F32 by llama-quantize",
        "source_file_sha256": GEMMA3_270M.sha256,
        "f32_gguf_sha256": sha256_file(f32),
        "engine": f"llama-server from the {PEER_SDIST} sdist ({' / '.join(version)}), f32 KV cache, one slot, "
                  f"context {CONTEXT}, --swa-full, no prompt cache, temperature 0, top-k 1",
        "conventions": {
            "prompt_token_ids": "llama.cpp's /tokenize of `text`, special tokens parsed, nothing added",
            "chat": "<bos> then <start_of_turn>{role}\\n{content}<end_of_turn>\\n per turn, then "
                    "<start_of_turn>model\\n",
            "greedy_ids": f"the first {OUTPUT_TOKENS} greedy ids; end of turn is not a stop",
        },
        "cases": cases,
    }, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
