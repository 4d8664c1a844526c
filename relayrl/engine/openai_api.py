"""The OpenAI protocol of the built-in server's ``/v1`` endpoints: requests, errors, rendering.

Owns the request bodies :class:`ChatIn` (``/v1/chat/completions``) and :class:`CompletionIn`
(``/v1/completions``), :class:`OpenAIError` and :func:`parse_body` (OpenAI's error shape
``{"error": {"message", "type", "param", "code"}}``, ``param`` naming the bad field), and
:func:`render_chat` (messages, and ``tools``, into prompt token ids through the tokenizer's
chat template; ``tools`` or ``tool_calls`` that the template leaves out of the prompt are
a 400, never dropped silently). The routes and the answers are ``relayrl.engine.chat``'s.

What is refused, and why: a field this server does not implement is a 400 naming it, never
silently ignored. Fields OpenAI clients may send at their neutral value (penalties 0, an
empty ``logit_bias``, ``response_format: {"type": "text"}``) are accepted at that value
only; ``tool_choice: "required"`` or a named function needs guided decoding, which the
built-in engine has not (vLLM's server has).

Rendering without a chat template (the task tokenizers): the first user message in the plain
template (``relayrl.models.loading.encode_prompt``) and every later message's content
appended as it is, which is exactly the token layout of an episode (docs/agents.md).

Imports: pydantic, the engine's plain types, relayrl.models.loading.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from relayrl.engine.types import MAX_TOP_LOGPROBS, SamplingParams
from relayrl.models.loading import encode_prompt


class OpenAIError(Exception):
    """A request error answered in OpenAI's shape; ``param`` names the field."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


# fields OpenAI defines that this server does not implement, with their neutral value(s)
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0,),  # 0.0 == 0
    "presence_penalty": (0,),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
}


def _check_neutral(data: dict[str, Any]) -> None:
    for name, neutral in NEUTRAL.items():
        if name in data and data[name] not in neutral:
            raise OpenAIError(
                f"{name}: not supported by relayrl's built-in server (only "
                f"{' or '.join(json.dumps(v) for v in neutral)} is accepted); "
                "vLLM's server (rollout.engine=vllm) implements more of the API",
                param=name,
                code="unsupported_field",
            )


def parse_body(model: type[BaseModel], data: Any) -> Any:
    """``model`` validated from the JSON ``data``; :class:`OpenAIError` naming the field."""
    if not isinstance(data, dict):
        raise OpenAIError("body: expected a JSON object")
    _check_neutral(data)
    data = {k: v for k, v in data.items() if k not in NEUTRAL}
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        # a union (``content``: text or parts) reports one error per member: the deepest
        # is the one that says what is wrong
        err = max(exc.errors(), key=lambda e: len(_path(e)))
        loc = _field(_path(err)) or "body"
        if err.get("type") == "extra_forbidden":
            raise OpenAIError(
                f"{loc}: unsupported field (relayrl's built-in server does not implement it)",
                param=loc,
                code="unsupported_field",
            ) from None
        raise OpenAIError(f"{loc}: {err.get('msg', 'invalid')}", param=loc) from None


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|(list|dict|literal)\[.*|[A-Z]\w*)$")


def _path(err: Any) -> list[str | int]:
    """An error's location without pydantic's union-member tags (``str``, ``list[int]``)."""
    return [x for x in err.get("loc", ()) if isinstance(x, int) or not _UNION_TAG.match(x)]


def _field(path: list[str | int]) -> str:
    """``["messages", 0, "content"]`` -> ``messages[0].content``."""
    out = ""
    for x in path:
        out += f"[{x}]" if isinstance(x, int) else (f".{x}" if out else x)
    return out


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCallIn(_Body):
    name: str
    arguments: str  # JSON, as OpenAI sends it


class ToolCallIn(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # some templates (Qwen3) render it

    def text(self) -> str:
        """The content as one string; text parts joined by newlines, as vLLM joins them."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class FunctionIn(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolIn(_Body):
    type: Literal["function"]
    function: FunctionIn


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """Sampling fields shared by both endpoints (extensions, as vLLM's: ``top_k``,
    ``ignore_eos``)."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    ignore_eos: bool = False
    # vLLM's switch for the token ids; accepted so that one client serves both backends:
    # this server always returns them
    return_token_ids: bool | None = None
    n: int = Field(1, ge=1, le=64)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None

    def sampling(self, index: int, max_tokens: int) -> SamplingParams:
        """The engine's parameters of choice ``index`` (seed + index: distinct samples)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=stop,
            seed=None if self.seed is None else self.seed + index,
            ignore_eos=self.ignore_eos,
        )

    def check_stream(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise OpenAIError("stream_options: only allowed with stream: true", "stream_options")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatIn(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolIn] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension (enable_thinking...)

    def checked(self) -> ChatIn:
        """Cross-field rules OpenAI applies; :class:`OpenAIError` naming the field."""
        self.check_stream()
        if self.top_logprobs and not self.logprobs:
            raise OpenAIError("top_logprobs: needs logprobs: true", "top_logprobs")
        if self.tool_choice is not None and self.tool_choice not in ("none", "auto"):
            raise OpenAIError(
                f"tool_choice: {json.dumps(self.tool_choice)} needs guided decoding, which "
                "relayrl's built-in engine has not; use 'auto' or 'none' "
                "(vLLM's server, rollout.engine=vllm, supports it)",
                "tool_choice",
                code="unsupported_value",
            )
        for i, message in enumerate(self.messages):
            if message.content is None and not (message.role == "assistant" and message.tool_calls):
                raise OpenAIError(
                    f"messages[{i}].content: null only for an assistant turn with tool_calls",
                    f"messages[{i}].content",
                )
        return self

    @property
    def max_new_tokens(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 128

    @property
    def parse_tools(self) -> bool:
        """Whether answers are parsed for tool calls (tools given and not ``tool_choice: none``)."""
        return bool(self.tools) and self.tool_choice != "none"


class CompletionIn(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = Field(16, gt=0)  # OpenAI's default
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def checked(self) -> CompletionIn:
        self.check_stream()
        if isinstance(self.prompt, list) and not self.prompt:
            raise OpenAIError("prompt: must not be empty", "prompt")
        return self


def prompts_of(tokenizer, body: CompletionIn) -> list[list[int]]:
    """Token ids of each prompt of a completions request (text is tokenized as it is, with
    the tokenizer's special tokens, as vLLM does)."""
    prompt = body.prompt
    items = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            if tokenizer is None:
                raise OpenAIError("prompt: text needs a tokenizer; send token ids", "prompt")
            out.append(tokenizer(item)["input_ids"])
        else:
            out.append([int(t) for t in item])
        if not out[-1]:
            raise OpenAIError(f"prompt[{i}]: empty after tokenization", "prompt")
    return out


def _template_message(i: int, message: ChatMessage) -> dict[str, Any]:
    """One message as chat templates expect it: text content, tool-call arguments as dicts."""
    out: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role}
    out["content"] = message.text()
    for key in ("name", "tool_call_id", "reasoning_content"):
        if getattr(message, key) is not None:
            out[key] = getattr(message, key)
    if message.tool_calls:
        calls = []
        for j, call in enumerate(message.tool_calls):
            where = f"messages[{i}].tool_calls[{j}].function.arguments"
            try:
                arguments = json.loads(call.function.arguments or "{}")
            except json.JSONDecodeError as exc:
                raise OpenAIError(f"{where}: not valid JSON ({exc})", where) from None
            function = {"name": call.function.name, "arguments": arguments}
            calls.append({"id": call.id, "type": "function", "function": function})
        out["tool_calls"] = calls
    return out


def render_chat(tokenizer, body: ChatIn) -> list[int]:
    """Prompt token ids of a conversation, ready for the assistant's next turn."""
    if getattr(tokenizer, "chat_template", None):
        messages = [_template_message(i, m) for i, m in enumerate(body.messages)]
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []] or None
        text = _apply_template(tokenizer, body, messages, tools)
        _check_tools_rendered(tokenizer, body, messages, tools, text)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return _render_plain(tokenizer, body)


def _apply_template(
    tokenizer, body: ChatIn, messages: list[dict[str, Any]], tools: list[dict] | None
) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=True,
            tokenize=False,
            **(body.chat_template_kwargs or {}),
        )
    except Exception as exc:  # noqa: BLE001 - a template's own error (jinja raise_exception)
        raise OpenAIError(f"messages: the chat template refused them: {exc}", "messages") from None


def _check_tools_rendered(
    tokenizer, body: ChatIn, messages: list[dict[str, Any]], tools: list[dict] | None, text: str
) -> None:
    """:class:`OpenAIError` where the chat template leaves ``tools`` or a message's
    ``tool_calls`` out of the prompt (SmolLM2's ChatML template renders neither): the model
    would answer as if they had not been sent. Told by rendering again without them."""
    if tools and _apply_template(tokenizer, body, messages, None) == text:
        raise OpenAIError(
            "tools: this model's chat template does not render tools (the prompt is the same "
            "with and without them), so the model would never see them; describe the tools "
            "in a system message instead, or serve a model whose template lists them",
            "tools",
            code="unsupported_value",
        )
    for i, message in enumerate(messages):
        if message.get("tool_calls"):
            bare = {key: value for key, value in message.items() if key != "tool_calls"}
            without = [*messages[:i], bare, *messages[i + 1 :]]
            if _apply_template(tokenizer, body, without, tools) == text:
                raise OpenAIError(
                    f"messages[{i}].tool_calls: this model's chat template does not render "
                    "tool calls, so the model would never see them; write the call into the "
                    "message's content instead",
                    f"messages[{i}].tool_calls",
                    code="unsupported_value",
                )


def _render_plain(tokenizer, body: ChatIn) -> list[int]:
    for name in ("tools", "chat_template_kwargs"):
        if getattr(body, name):
            raise OpenAIError(f"{name}: this model's tokenizer has no chat template", name)
    if any(m.tool_calls for m in body.messages):
        raise OpenAIError("messages: tool_calls need a chat template to render them", "messages")
    head = [m.text() for m in body.messages if m.role in ("system", "developer")]
    rest = [m for m in body.messages if m.role not in ("system", "developer")]
    if not rest or rest[0].role != "user":
        raise OpenAIError("messages: the first non-system message must be the user's", "messages")
    ids = encode_prompt(tokenizer, "\n".join([*head, rest[0].text()]))
    for message in rest[1:]:
        ids += tokenizer(message.text(), add_special_tokens=False)["input_ids"]
    return ids
