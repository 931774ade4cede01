"""Tool calls a model chose to make (`tool_choice: "auto"`), read from its own call syntax.

With "auto" the output is not constrained: the model writes text, calls, or both, in the syntax
its chat template taught it. The one syntax read here is Hermes' (Qwen2.5, Hermes and the many
templates that copy them): each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
`call_syntax` finds it in a chat template; a template that renders tools in another syntax gets a
400 at the API (no parser for it), never calls read the wrong way.

- `split_calls(text, names)`: the text before the first call (the message's content, None when
  empty) and the calls; a block that does not parse as a call of one of `names` means no calls at
  all (the whole output is content), so a client never gets a call the model did not write.
- `CallHoldback`: for streams, the content that can be sent now — everything up to where a call
  may start (a tail that could begin `<tool_call>` is held until the next text says otherwise).
"""

from __future__ import annotations

import json
import re

HERMES = "hermes"
START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(START) + r"\s*(.*?)\s*(?:" + re.escape(END) + r"|$)", re.DOTALL)


def call_syntax(chat_template: str | None) -> str | None:
    """The call syntax a chat template teaches (HERMES), or None when it renders no calls this
    server can read."""
    if chat_template is not None and "tools" in chat_template and START in chat_template:
        return HERMES
    return None


def split_calls(text: str, names: tuple[str, ...]) -> tuple[str | None, list[tuple[str, str]]]:
    """(content, calls) of a whole output: each call is (name, arguments as JSON text). No call
    block: (text, []). A block that is not a JSON object with a `name` of `names` and object
    `arguments` (an unfinished one does not parse): the whole text is content. The closing tag
    may be missing where the output ended right after the call."""
    start = text.find(START)
    if start < 0:
        return text, []
    calls = []
    for block in _BLOCK.finditer(text, start):
        try:
            call = json.loads(block.group(1))
        except ValueError:
            return text, []
        args = call.get("arguments", {}) if isinstance(call, dict) else None
        if not isinstance(call, dict) or call.get("name") not in names or not isinstance(args, dict):
            return text, []
        calls.append((call["name"], json.dumps(args)))
    content = text[:start].strip()
    return content or None, calls


class CallHoldback:
    """Splits a streamed output into content to send now and a tail held back: from the first
    `<tool_call>` on, everything is held (it is read whole at the end); before it, only a tail
    that could still become `<tool_call>`."""

    def __init__(self) -> None:
        self._held = ""
        self.calling = False  # a call block started: the rest is held

    def feed(self, text: str) -> str:
        """The content of `text` (after what was held) that can be sent now."""
        if self.calling:
            self._held += text
            return ""
        pending = self._held + text
        at = pending.find(START)
        if at >= 0:
            self.calling, self._held = True, pending[at:]
            return pending[:at]
        keep = next((n for n in range(min(len(START) - 1, len(pending)), 0, -1) if START.startswith(pending[-n:])), 0)
        self._held = pending[len(pending) - keep:]
        return pending[:len(pending) - keep]

    def held(self) -> str:
        """What is held back (read at the end)."""
        return self._held
