"""Tool calls in generated text: which format a chat template uses, and parsing a completion
back into OpenAI ``tool_calls``.

Owns :func:`detect_formats` (from the chat template's text) and :func:`parse_tool_calls`
for two formats:

- ``hermes`` (Qwen 2/2.5/3, Hermes, many fine-tunes): each call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; text before the first call
  is the message's content. An unclosed last ``<tool_call>`` (the model stopped on EOS right
  after the JSON) is accepted.
- ``llama3_json`` (Llama 3.1/3.2/3.3 with JSON tool calling): the whole answer is one JSON
  object ``{"name": ..., "parameters": {...}}`` (``arguments`` accepted too), optionally
  after ``<|python_tag|>``, several separated by ``;``.

Text that does not parse (bad JSON, no name) is left as content, as OpenAI servers do: a
tool call is only reported when it is well formed.

Imports: the standard library.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

FORMATS = ("hermes", "llama3_json")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def to_openai(self, call_id: str | None = None) -> dict[str, Any]:
        """The OpenAI ``tool_calls`` entry (arguments as a JSON string, as OpenAI sends)."""
        return {
            "id": call_id or f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {
                "name": self.name,
                "arguments": json.dumps(self.arguments, ensure_ascii=False),
            },
        }


def detect_formats(chat_template: str | None) -> tuple[str, ...]:
    """The tool-call formats to try for a model with this chat template, most likely first."""
    template = chat_template or ""
    if HERMES_OPEN in template:
        return ("hermes",)
    if PYTHON_TAG in template or '"parameters"' in template:
        return ("llama3_json",)
    return FORMATS


def _call_from(obj: Any, argument_keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    for key in argument_keys:
        if key in obj:
            args = obj[key]
            if isinstance(args, str):  # some models emit the arguments JSON-encoded
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    return None
            return ToolCall(obj["name"], args) if isinstance(args, dict) else None
    return ToolCall(obj["name"], {})


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a hermes-format answer; ``(text, [])`` if no call parses."""
    start = text.find(HERMES_OPEN)
    if start < 0:
        return text, []
    calls = []
    for body in _HERMES.findall(text, start):
        try:
            call = _call_from(json.loads(body.strip()), ("arguments", "parameters"))
        except json.JSONDecodeError:
            call = None
        if call is None:
            return text, []
        calls.append(call)
    content = text[:start].strip()
    return content or None, calls


def parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a Llama 3 JSON answer; ``(text, [])`` if it is not one."""
    rest = text.strip()
    if rest.startswith(PYTHON_TAG):
        rest = rest[len(PYTHON_TAG) :].lstrip()
    if not rest.startswith("{"):
        return text, []
    decoder, calls = json.JSONDecoder(), []
    while rest:
        try:
            obj, end = decoder.raw_decode(rest)
        except json.JSONDecodeError:
            return text, []
        call = _call_from(obj, ("parameters", "arguments"))
        if call is None:
            return text, []
        calls.append(call)
        rest = rest[end:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        elif rest:
            return text, []
    return None, calls


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}


def parse_tool_calls(text: str, formats: tuple[str, ...] = FORMATS) -> tuple[str | None, list]:
    """(content, calls) by the first of ``formats`` that finds a well-formed call."""
    for name in formats:
        content, calls = PARSERS[name](text)
        if calls:
            return content, calls
    return text, []


def hold_back(text: str, formats: tuple[str, ...]) -> int:
    """How many characters of a partial answer may be streamed as content: everything
    before what may become a tool call (a ``<tool_call>`` or a prefix of it at the end for
    hermes; an answer that starts like a JSON call for llama3_json)."""
    safe = len(text)
    if "hermes" in formats:
        start = text.find(HERMES_OPEN)
        safe = start if start >= 0 else len(text) - partial_suffix(text, HERMES_OPEN)
    if "llama3_json" in formats:
        head = text.lstrip()
        if not head or head.startswith("{") or _is_prefix_either(head, PYTHON_TAG):
            safe = 0
    return safe


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _is_prefix_either(a: str, b: str) -> bool:
    return a.startswith(b) or b.startswith(a)
