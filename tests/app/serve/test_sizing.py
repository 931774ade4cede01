"""KV pool sizing against the context, per role: plans, verdicts, refusal, clamping, `kvfence check`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvfence.app.config.config import ServeConfig, load_config
from kvfence.app.serve.sizing import (
    PoolPlan, SizingVerdict, UndersizedPoolError, check_sizing, plan_pools, render_table, resolve_context,
)
from kvfence.app.serve.workers import build_workers
from kvfence.engine.checkpoint import Checkpoint, read_config
from kvfence.engine.loading import pick_device, pick_dtype
from kvfence.engine.model_config import ModelConfig

FP32, BF16 = 4, 2
# 2 layers x (K + V) x 2 KV heads x head_dim 8 = 64 elements per token.
TINY = ModelConfig(architecture="llama", num_layers=2, hidden_size=32, intermediate_size=64, num_heads=4,
                   num_kv_heads=2, head_dim=8, vocab_size=100, max_context_tokens=64)


@pytest.fixture(scope="module")
def smol(default_model_path: Path) -> ModelConfig:
    """The default model's architecture, from its GGUF metadata only."""
    return read_config(default_model_path)


def serve_config(**flags: object) -> ServeConfig:
    """A config from settings named as their flags' dests, e.g. page_size_tokens=4."""
    return load_config(flags, {}, None)


def by_role(verdicts: list[SizingVerdict]) -> dict[str, tuple[int, int, float, str]]:
    return {v.role: (v.pool_tokens, v.context_tokens, v.ratio, v.verdict) for v in verdicts}


def test_bytes_per_token_of_the_default_model(smol: ModelConfig) -> None:
    assert smol.max_context_tokens == 8192
    fp32 = plan_pools(ServeConfig(), smol, FP32)
    bf16 = plan_pools(ServeConfig(), smol, BF16)
    assert [p.bytes_per_token for p in fp32] == [46_080, 46_080]
    assert [p.bytes_per_token for p in bf16] == [23_040, 23_040]
    assert fp32[0].pool_bytes == 16_384 * 46_080


def test_bytes_per_token_of_a_hand_made_model() -> None:
    plans = plan_pools(serve_config(page_size_tokens=4), TINY, FP32)
    assert [p.bytes_per_token for p in plans] == [256, 256]
    assert plan_pools(serve_config(page_size_tokens=4), TINY, BF16)[0].bytes_per_token == 128


def test_default_pools_hold_two_and_four_contexts(smol: ModelConfig) -> None:
    plans = plan_pools(ServeConfig(), smol, FP32)
    assert [(p.role, p.num_pages, p.page_size_tokens, p.pool_tokens) for p in plans] == [
        ("prefill", 1024, 16, 16_384), ("decode", 2048, 16, 32_768)]
    context, verdicts = resolve_context(ServeConfig(), smol, plans)
    assert context == 8192
    assert by_role(verdicts) == {"prefill": (16_384, 8192, 2.0, "ok"), "decode": (32_768, 8192, 4.0, "ok")}


def test_max_context_sizes_default_pools_and_is_capped_at_the_model(smol: ModelConfig) -> None:
    short = serve_config(max_context=1000)
    plans = plan_pools(short, smol, FP32)
    assert [p.num_pages for p in plans] == [125, 250]  # ceil(2 * 1000 / 16), ceil(4 * 1000 / 16)
    assert resolve_context(short, smol, plans)[0] == 1000
    long = serve_config(max_context=100_000)
    plans = plan_pools(long, smol, FP32)
    assert [p.num_pages for p in plans] == [1024, 2048]
    assert resolve_context(long, smol, plans)[0] == 8192


@pytest.mark.parametrize("pages, verdict", [(15, "undersized"), (16, "warn"), (31, "warn"), (32, "ok")])
def test_verdict_boundaries(pages: int, verdict: str) -> None:
    plans = plan_pools(serve_config(page_size_tokens=4, prefill_num_pages=pages), TINY, FP32)
    prefill = check_sizing(plans, 64)[0]
    assert (prefill.role, prefill.pool_tokens, prefill.verdict) == ("prefill", 4 * pages, verdict)
    assert prefill.ratio == pytest.approx(4 * pages / 64)


def test_a_pool_under_two_contexts_warns_and_is_served(smol: ModelConfig) -> None:
    config = serve_config(prefill_num_pages=768)  # 12,288 tokens = 1.5 contexts
    context, verdicts = resolve_context(config, smol, plan_pools(config, smol, FP32))
    assert context == 8192
    assert by_role(verdicts) == {"prefill": (12_288, 8192, 1.5, "warn"), "decode": (32_768, 8192, 4.0, "ok")}
    assert "1.50 x the context of 8192 tokens (warn)" in verdicts[0].describe()


def test_an_undersized_prefill_pool_is_refused(smol: ModelConfig) -> None:
    config = serve_config(prefill_num_pages=8)  # 8 x 16 = 128 tokens
    with pytest.raises(UndersizedPoolError) as e:
        resolve_context(config, smol, plan_pools(config, smol, FP32))
    message = str(e.value)
    assert isinstance(e.value, ValueError)
    for part in ("prefill KV pool", "128 tokens", "8192 tokens", "--prefill-num-pages 512",
                 "--prefill-kv-memory 360MiB", "--max-context 128", "--clamp-context"):
        assert part in message, part
    assert "decode" not in message
    assert e.value.fitting_context_tokens == 128


def test_clamp_context_shrinks_to_the_prefill_pool(smol: ModelConfig) -> None:
    config = serve_config(prefill_num_pages=8, clamp_context=True)
    context, verdicts = resolve_context(config, smol, plan_pools(config, smol, FP32))
    assert context == 128
    assert by_role(verdicts) == {"prefill": (128, 128, 1.0, "warn"), "decode": (32_768, 128, 256.0, "ok")}


def test_an_undersized_decode_pool_is_refused_or_clamped(smol: ModelConfig) -> None:
    config = serve_config(decode_num_pages=4)  # 64 tokens
    with pytest.raises(UndersizedPoolError) as e:
        resolve_context(config, smol, plan_pools(config, smol, FP32))
    message = str(e.value)
    for part in ("decode KV pool", "64 tokens", "8192 tokens", "--decode-num-pages 512", "--decode-kv-memory",
                 "--max-context 64", "--clamp-context"):
        assert part in message, part
    assert "prefill" not in message
    clamped = serve_config(decode_num_pages=4, clamp_context=True)
    context, verdicts = resolve_context(clamped, smol, plan_pools(clamped, smol, FP32))
    assert context == 64
    assert by_role(verdicts) == {"prefill": (16_384, 64, 256.0, "ok"), "decode": (64, 64, 1.0, "warn")}


def test_both_pools_undersized_names_both_and_clamps_to_the_smaller() -> None:
    pools = dict(page_size_tokens=4, prefill_num_pages=10, decode_num_pages=6)  # 40 and 24 of 64
    config = serve_config(**pools)
    plans = plan_pools(config, TINY, FP32)
    with pytest.raises(UndersizedPoolError, match=r"prefill KV pool holds 40 tokens.*decode KV pool holds 24"):
        resolve_context(config, TINY, plans)
    context, verdicts = resolve_context(serve_config(**pools, clamp_context=True), TINY, plans)
    assert context == 24
    assert by_role(verdicts) == {"prefill": (40, 24, 40 / 24, "warn"), "decode": (24, 24, 1.0, "warn")}


def test_colocated_is_one_pool_sized_like_decode(smol: ModelConfig) -> None:
    plans = plan_pools(serve_config(disaggregation="off", prefill_num_pages=8), smol, FP32)
    assert [(p.role, p.num_pages) for p in plans] == [("colocated", 2048)]  # 4 contexts; prefill flags ignored
    config = serve_config(disaggregation="off", decode_num_pages=4)
    plans = plan_pools(config, smol, FP32)
    assert [(p.role, p.num_pages) for p in plans] == [("colocated", 4)]
    with pytest.raises(UndersizedPoolError) as e:
        resolve_context(config, smol, plans)
    assert "colocated KV pool holds 64 tokens" in str(e.value)
    assert "--decode-num-pages" in str(e.value) and "--prefill-num-pages" not in str(e.value)


def test_kv_memory_sets_the_page_count(smol: ModelConfig) -> None:
    config = serve_config(prefill_kv_memory="1GiB", decode_kv_memory="1GiB")
    # 2**30 // (46,080 B x 16 tokens) = 1456; 2**30 // (23,040 B x 16) = 2912.
    assert [p.num_pages for p in plan_pools(config, smol, FP32)] == [1456, 1456]
    assert [p.num_pages for p in plan_pools(config, smol, BF16)] == [2912, 2912]
    assert plan_pools(serve_config(page_size_tokens=4, prefill_kv_memory="1GiB"), TINY, FP32)[0].num_pages == 2**20
    tiny = serve_config(prefill_kv_memory="1KiB")  # less than one page: one page, then refused
    plans = plan_pools(tiny, smol, FP32)
    assert plans[0].num_pages == 1
    with pytest.raises(UndersizedPoolError, match="16 tokens"):
        resolve_context(tiny, smol, plans)


def test_explicit_pages_win_over_memory(smol: ModelConfig) -> None:
    config = serve_config(prefill_num_pages=600, prefill_kv_memory="1GiB")
    assert plan_pools(config, smol, FP32)[0].num_pages == 600


def test_plans_and_verdicts_reject_inconsistent_numbers() -> None:
    with pytest.raises(ValueError, match="pool_tokens 100 != 8 pages x 16 tokens"):
        PoolPlan(role="prefill", num_pages=8, page_size_tokens=16, bytes_per_token=4, pool_tokens=100, pool_bytes=400)
    with pytest.raises(ValueError, match="context must be > 0"):
        SizingVerdict(role="prefill", pool_tokens=128, bytes_per_token=4, context_tokens=0)
    with pytest.raises(ValueError, match="element_size must be > 0"):
        plan_pools(ServeConfig(), TINY, 0)


def test_clamp_context_setting() -> None:
    assert ServeConfig().pools.clamp_context is False
    assert load_config({"clamp_context": True}, {}, None).pools.clamp_context is True
    assert load_config({"clamp_context": None}, {}, None).pools.clamp_context is False


def test_clamp_context_from_the_config_file(tmp_path: Path) -> None:
    f = tmp_path / "kvfence.toml"
    f.write_text("[pools]\nclamp-context = true\n")
    assert load_config({"clamp_context": None}, {}, f).pools.clamp_context is True


def parse_table(text: str) -> dict[str, list[str]]:
    lines = text.strip().splitlines()
    assert re.split(r"\s{2,}", lines[0].strip()) == [
        "role", "pool tokens", "bytes per token", "context", "ratio", "verdict"]
    return {line.split()[0]: line.split()[1:] for line in lines[1:] if line.split()[0] in (
        "prefill", "decode", "colocated")}


def test_render_table() -> None:
    verdicts = [SizingVerdict(role="prefill", pool_tokens=128, bytes_per_token=46_080, context_tokens=8192),
                SizingVerdict(role="decode", pool_tokens=32_768, bytes_per_token=46_080, context_tokens=8192)]
    assert parse_table(render_table(verdicts)) == {
        "prefill": ["128", "46080", "8192", "0.0156", "undersized"],
        "decode": ["32768", "46080", "8192", "4.00", "ok"],
    }


def test_build_workers_allocates_the_planned_pools(smollm2: Checkpoint) -> None:
    base = dict(max_context=256, prefill_device="cpu", decode_device="cpu", dtype="float32")
    workers = build_workers(serve_config(**base, prefill_num_pages=24), smollm2)
    assert workers.decode is not None
    assert (workers.prefill.role, workers.prefill.pool.num_pages) == ("prefill", 24)
    assert (workers.decode.role, workers.decode.pool.num_pages) == ("decode", 64)  # 4 x 256 / 16
    # Both roles are on the CPU: one compute thread runs them both (engine/compute.py).
    assert list(workers.compute) == [torch.device("cpu")]
    assert workers.compute_of(workers.prefill) is workers.compute_of(workers.decode)
    workers.close()
    colocated = build_workers(serve_config(**base, disaggregation="off", decode_kv_memory="12MiB"), smollm2)
    assert colocated.decode is None
    assert (colocated.prefill.role, colocated.prefill.pool.num_pages) == ("colocated", 12 * 2**20 // (46_080 * 16))
    assert workers.max_context_tokens == colocated.max_context_tokens == 256
    colocated.close()
    with pytest.raises(UndersizedPoolError, match="holds 16 tokens"):  # refused before allocating
        build_workers(serve_config(**base, disaggregation="off", decode_kv_memory="1MiB"), smollm2)
    clamped = build_workers(serve_config(**base, disaggregation="off", decode_kv_memory="1MiB", clamp_context=True),
                            smollm2)
    assert clamped.max_context_tokens == 16
    clamped.close()


def kvfence_check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvfence.app.cli", "check", *args], capture_output=True,
                          text=True, timeout=300, check=False)


def test_check_command(default_model_path: Path) -> None:
    model = ("--model", str(default_model_path))
    per_token = 46_080 // 4 * pick_dtype("auto", pick_device("auto")).itemsize  # bf16 where CUDA is
    ok = kvfence_check(*model)
    assert ok.returncode == 0, ok.stderr
    assert parse_table(ok.stdout) == {"prefill": ["16384", str(per_token), "8192", "2.00", "ok"],
                                      "decode": ["32768", str(per_token), "8192", "4.00", "ok"]}

    refused = kvfence_check(*model, "--decode-num-pages", "4")
    assert refused.returncode == 1, refused.stderr
    assert parse_table(refused.stdout)["decode"] == ["64", str(per_token), "8192", "0.0078", "undersized"]
    assert "decode KV pool holds 64 tokens" in refused.stderr and "8192 tokens" in refused.stderr
    assert "--clamp-context" in refused.stderr

    clamped = kvfence_check(*model, "--decode-num-pages", "4", "--clamp-context")
    assert clamped.returncode == 0, clamped.stderr
    assert parse_table(clamped.stdout) == {"prefill": ["16384", str(per_token), "64", "256.00", "ok"],
                                           "decode": ["64", str(per_token), "64", "1.00", "warn"]}
    assert "context clamped from 8192 to 64 tokens" in clamped.stdout
    # the weights a worker holds, by how it holds them (engine/weight_size.py; the sizes themselves
    # are checked against a built model in tests/engine/test_native_weights.py)
    if pick_device("auto").type == "cpu":
        assert "weights (--weights native): 92.1 MiB per worker (Q4_1 63.3, Q8_0 28.7, float32 0.1 MiB); " \
               "the file: 61 F32, 210 Q4_1, 1 Q8_0" in ok.stdout
        assert "weights (--weights float32): 621.1 MiB" in kvfence_check(*model, "--weights", "float32").stdout
