"""Chat templates (Jinja2, as shipped with the model) rendered in a sandbox."""

from __future__ import annotations

import datetime
import functools
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The messages cannot be rendered with the model's template; the message says why."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the model's chat template does not compile: {e}") from e


def render_chat(template: str | None, messages: list[dict[str, Any]], *, bos_token: str = "",
                eos_token: str = "", add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None) -> str:
    """Render `messages` (dicts with role and content) into the prompt text; `tools` (OpenAI's
    tool definitions) are given to templates that render them."""
    if not template:
        raise ChatTemplateError("this model has no chat template; use /v1/completions with a raw prompt")
    try:
        return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=bos_token, eos_token=eos_token, tools=tools)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed on these messages: {e}") from e
