"""Penalties, logit bias and logprobs through the real scheduler and workers (tiny random Llama),
colocated and disaggregated: the first token is picked by the prefill worker and the rest by the
decode worker, each from the counts its lease was given, and the tokens must equal a slow
reference that recomputes the whole sequence for every token. Logprobs are the model's raw
log-softmax at every position. A preempted request recomputes its counts on its new leases."""

from __future__ import annotations

import dataclasses

import anyio
import pytest
import torch
from sampling_reference import slow_greedy, slow_prompt_logprobs
from serving_harness import assert_baseline, serve_all, small_config, start_serving, wait_idle

from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.kv_pool import KVPool
from kvfence.engine.models.registry import build_model
from kvfence.engine.runner import ModelRunner
from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.core.config import SchedulerConfig
from kvfence.scheduler.offline import OfflineEngine

PAGE = 4
CONTEXT = 96
PENALIZED = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, presence_penalty=0.8, frequency_penalty=0.5,
                           repetition_penalty=1.6, logit_bias=((7, 3.0), (11, -50.0)))


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (int(torch.randint(4, 24, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def reference(tiny: Checkpoint, ps: list[list[int]], params: SamplingParams) -> list[tuple[list[int], list[torch.Tensor]]]:
    model = build_model(tiny, torch.float32)
    engine = OfflineEngine(ModelRunner(model, KVPool(model.config, 64, PAGE, torch.float32)), tiny.tokenizer,
                           chunk_tokens=16)
    return [slow_greedy(engine, p, params, params.max_tokens or 1) for p in ps]


def config(mode: str) -> SchedulerConfig:
    return small_config(mode, PAGE, CONTEXT)


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["colocated", "inprocess", "tcp"])
async def test_penalties_and_bias_equal_the_slow_reference_and_logprobs_are_the_models(
        tiny: Checkpoint, mode: str, task_group: anyio.abc.TaskGroup) -> None:
    ps = prompts(4, seed=5)
    params = dataclasses.replace(PENALIZED, logprobs=3)
    want = reference(tiny, ps, params)  # before serving: it blocks the event loop the endpoints ping on
    plain = reference(tiny, ps[:1], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0][0]
    assert plain != want[0][0]  # the controls change the output, so equality below means something
    serving = await start_serving(task_group, tiny, mode, config(mode), num_pages=64)
    results = await serve_all(serving.scheduler, ps, [params] * len(ps))
    for out, (want_ids, raw_rows) in zip(results, want):
        ids, logprobs = out.ids, out.logprobs
        assert out.end == "length" and ids == want_ids
        assert len(logprobs) == len(ids)
        for token, entry, raw in zip(ids, logprobs, raw_rows):
            lp = torch.log_softmax(raw.double(), -1)
            assert entry.logprob == pytest.approx(lp[token].item(), abs=1e-4)
            assert entry.top_ids == lp.topk(3).indices.tolist()
            assert entry.top_logprobs == pytest.approx(lp.topk(3).values.tolist(), abs=1e-4)
    assert 11 not in [t for out in results for t in out.ids]  # biased away
    await wait_idle(serving.scheduler)
    assert_baseline(serving.scheduler)
    await serving.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["colocated", "inprocess", "tcp"])
async def test_prompt_logprobs_are_the_models_across_chunks_even_for_a_cached_prompt(
        tiny: Checkpoint, mode: str, task_group: anyio.abc.TaskGroup) -> None:
    """A 40-token prompt prefilled in chunks of 16: every prompt token after the first gets the
    model's log-probability given the tokens before it; a prompt whose pages are cached is
    computed again for it; a request of one token carries them on its only delta."""
    prompt = prompts(1, seed=9)[0] * 3
    prompt = (prompt + list(range(40, 80)))[:40]
    model = build_model(tiny, torch.float32)
    want = slow_prompt_logprobs(OfflineEngine(ModelRunner(model, KVPool(model.config, 64, PAGE, torch.float32)),
                                              tiny.tokenizer, chunk_tokens=16), prompt)
    serving = await start_serving(task_group, tiny, mode, config(mode), num_pages=64)
    plain = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    [cold] = await serve_all(serving.scheduler, [prompt], [plain])  # caches its full pages
    assert cold.prompt_logprobs == []
    scored = [dataclasses.replace(plain, prompt_logprobs=2), dataclasses.replace(plain, prompt_logprobs=0, max_tokens=1)]
    results = await serve_all(serving.scheduler, [prompt, prompt], scored)
    for out, top in zip(results, (2, 0)):
        assert len(out.prompt_logprobs) == len(prompt) - 1 and out.end == "length"
        for k, entry in enumerate(out.prompt_logprobs):
            lp = want[k]
            assert entry.logprob == pytest.approx(lp[prompt[k + 1]].item(), abs=1e-4)
            assert entry.top_ids == lp.topk(top).indices.tolist()
            assert entry.top_logprobs == pytest.approx(lp.topk(top).values.tolist(), abs=1e-4)
    assert results[0].ids == cold.ids  # scoring changes nothing of the output
    await wait_idle(serving.scheduler)
    await serving.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["colocated", "tcp"])
async def test_a_preempted_penalized_request_recounts_on_its_new_leases(
        tiny: Checkpoint, mode: str, task_group: anyio.abc.TaskGroup) -> None:
    """A pool of 30 pages and six requests that grow to 9-16 pages: the newest are preempted and
    recomputed; their penalties must still see every token they generated before."""
    ps = prompts(6, seed=2)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, frequency_penalty=0.6, repetition_penalty=1.3)
    want = reference(tiny, ps, params)
    serving = await start_serving(task_group, tiny, mode, config(mode), num_pages=30)
    s = serving.scheduler
    results = await serve_all(s, ps, [params] * len(ps))
    assert [r.ids for r in results] == [w[0] for w in want]
    assert s.metrics.preemptions._value.get() > 0  # the pool really ran out mid-generation
    assert all(r.logprobs == [] for r in results)  # no logprobs asked for, none sent
    await wait_idle(s)
    await serving.aclose()
