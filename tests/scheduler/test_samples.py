"""Several samples of one request (OpenAI's `n`) through the real scheduler, workers and
transports (tiny model): the prompt is prefilled once and moved once, the other samples share its
pages read-only and compute only the page of the last prompt token; every sample's tokens equal
what it would produce alone (greedy: the cold answer; seeded: a solo request with seed + i); the
samples are admitted or refused together; an aborted first sample does not hold the others; every
page comes back.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from serving_harness import Serving, read_each, serving_in, wait_idle

from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.core.errors import AdmissionRejected
from kvfence.scheduler.handle import RequestHandle
from kvfence.scheduler.core.tenants import Tenant
from test_prefix_cache import cache_config, moved_pages, run
from test_scheduler import offline_greedy

T = Tenant(name="t")
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
PROMPT = list(range(20, 50))  # 30 tokens: 7 full pages shareable, the 8th holds the last two


@pytest.fixture(params=["colocated", "inprocess", "tcp"])
async def serving(request: pytest.FixtureRequest, tiny: Checkpoint) -> AsyncIterator[Serving]:
    async with serving_in(tiny, request.param, cache_config(request.param, max_queue=6), num_pages=48) as s:
        yield s


async def run_all(handles: list[RequestHandle]) -> list[tuple[list[int], int, str | None]]:
    return await read_each(handles, run)


def samples(params: SamplingParams, n: int) -> list[SamplingParams]:
    return [params.for_sample(i) for i in range(n)]


@pytest.mark.anyio
async def test_the_prompt_is_prefilled_and_moved_once_and_every_sample_gets_the_cold_answer(
        serving: Serving, tiny: Checkpoint) -> None:
    s = serving.scheduler
    want = offline_greedy(tiny, [PROMPT], 6)[0][0]
    moved = moved_pages(serving)
    outs = await run_all(s.submit_samples(PROMPT, samples(GREEDY, 3), T))
    await wait_idle(s)
    # the first sample computed the prompt; the others found its 7 full pages (28 tokens) cached
    assert outs == [(want, 0, None), (want, 28, None), (want, 28, None)]
    assert s.metrics.prefilled.labels("t")._value.get() == 30 + 2 * 2
    if s.link is not None:  # the whole prompt once (8 pages), then each other sample's last page
        assert moved_pages(serving) - moved == 8 + 2 * 1


@pytest.mark.anyio
async def test_seeded_samples_are_each_what_a_solo_request_with_seed_plus_i_gives(serving: Serving) -> None:
    s = serving.scheduler
    together = [o[0] for o in await run_all(s.submit_samples(PROMPT, samples(SEEDED, 3), T))]
    again = [o[0] for o in await run_all(s.submit_samples(PROMPT, samples(SEEDED, 3), T))]
    s.flush_cache()
    alone = [(await run(s.submit(PROMPT, SamplingParams(temperature=1.0, seed=11 + i, max_tokens=8,
                                                         ignore_eos=True), T)))[0] for i in range(3)]
    assert together == again == alone
    assert len({tuple(ids) for ids in together}) == 3  # distinct seeds, distinct samples
    await wait_idle(s)


@pytest.mark.anyio
async def test_an_aborted_first_sample_does_not_hold_up_the_others(serving: Serving, tiny: Checkpoint) -> None:
    s = serving.scheduler
    want = offline_greedy(tiny, [PROMPT], 6)[0][0]
    first, *others = s.submit_samples(PROMPT, samples(GREEDY, 3), T)
    first.abort()
    outs = await run_all([first, *others])
    assert outs[0][2] == "client_closed"
    assert [o[0] for o in outs[1:]] == [want, want]
    await wait_idle(s)


@pytest.mark.anyio
async def test_samples_are_admitted_or_refused_together(serving: Serving) -> None:
    s = serving.scheduler
    with pytest.raises(AdmissionRejected) as info:  # more than the queue ever holds: a 400 naming n
        s.submit_samples(PROMPT, samples(GREEDY, 7), T)
    assert (info.value.status, info.value.param) == (400, "n")
    capped = Tenant(name="capped", max_queued=2)
    with pytest.raises(AdmissionRejected) as info:  # the tenant may queue 2: all 3 are refused
        s.submit_samples(PROMPT, samples(GREEDY, 3), capped)
    assert info.value.status == 429
    assert s.in_flight() == 0
    await wait_idle(s)
