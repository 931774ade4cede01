"""How much one request may make the server hold and send: a budget on its fan-out.

A request multiplies what it costs: `n` (or completions' `best_of`) samples, each up to
`max_tokens` tokens, each token with `top_logprobs` alternatives, and with completions' `echo`
and `logprobs` every prompt token scored again per choice. Unbounded, 128 samples x 20
alternatives x a whole context, not streamed, is gigabytes held and encoded at once from one
request. So the entries a response may carry are counted before anything is admitted:

    samples x (top_logprobs + 1) x max_tokens  +  n x prompt tokens x (logprobs + 1) with echo

(`max_tokens` as given, or what the context leaves when absent; top_logprobs + 1 is 1 without
logprobs), and a request over `--max-response-entries` is refused with 400 that states the count
and the limit. A whole response is built from what its samples produced, so it never holds more
than the budget.
"""

from __future__ import annotations

from kvfence.scheduler.core.errors import RequestError

DEFAULT_MAX_RESPONSE_ENTRIES = 1 << 18  # n = 1 with 20 alternatives over an 8,192-token context fits


def response_entries(*, samples: int, logprobs: int | None, max_tokens: int, n: int, prompt_tokens: int,
                     prompt_logprobs: int | None) -> int:
    """The most tokens and logprob entries the response may carry (see the module docstring)."""
    out = samples * ((logprobs or 0) + 1) * max_tokens
    if prompt_logprobs is not None:
        out += n * prompt_tokens * (prompt_logprobs + 1)
    return out


def check_response_budget(entries: int, budget: int, *, max_param: str, n: int, samples: int,
                          logprobs: int | None, max_tokens: int) -> None:
    """400 `response_too_large` (param `max_param`) when `entries` is over `budget`."""
    if entries <= budget:
        return
    parts = [f"{samples} samples" if samples > 1 else "1 sample", f"up to {max_tokens} tokens each"]
    if logprobs:
        parts.append(f"{logprobs} logprob alternatives per token")
    raise RequestError(400, "response_too_large", f"this request may produce {entries} tokens and logprob entries "
                       f"({', '.join(parts)}); this server answers at most {budget} per request. Lower "
                       f"{max_param}, n{', best_of' if samples > n else ''} or the number of logprobs.",
                       param=max_param)
