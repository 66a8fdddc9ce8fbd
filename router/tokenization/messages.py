"""OpenAI chat messages and tools -> what vLLM hands the chat template.

vLLM (`vllm/entrypoints/chat_utils.py`, `parse_chat_messages` and `_postprocess_messages`)
rebuilds every message before rendering; the template never sees the request as sent:

- `content`: None becomes no parts, a string becomes one text part; parts of type `text`,
  `input_text`, `output_text`, `refusal` and `thinking` (and bare strings) contribute their
  text (a text part whose text is null is skipped). With the "string" content format the
  texts are joined with "\\n" into one string; with "openai" they stay a list of
  `{"type": "text", "text": ...}`. Media parts (images, audio, video) need a multimodal
  model: `UnsupportedContent` here.
- kept keys: `role`, `content`; `name` when a string; `task` when a string; assistant
  `tool_calls` (when not null) and `reasoning` (copied to `reasoning_content` too); tool
  `tool_call_id`, and a tool message's list content collapsed to its joined text; a
  developer message's `tools`. Any other key is dropped.
- an assistant's empty `tool_calls` list is removed; each call's `function.arguments`
  string is parsed as JSON (invalid JSON becomes `{}`; neither a dict nor a list: `{}`).

Tools (`ChatCompletionToolsParam.model_dump()`): `{"type", "function": {"name",
"description", "parameters", "strict", ...extra}, ...extra}` with absent fields as null.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

from router.tokenization.template import ContentFormat

TEXT_PART_TYPES: Final = frozenset({"text", "input_text", "output_text", "refusal", "thinking"})
_PART_FIELD: Final = {"refusal": "refusal", "thinking": "thinking"}


class ChatInputError(ValueError):
    """Messages or tools vLLM would refuse (400)."""


class UnsupportedContent(ChatInputError):
    """A media part: only a multimodal model (and its processor) can tokenize it."""


def _part_text(part: Any) -> str | None:
    if isinstance(part, str):
        return part
    if not isinstance(part, Mapping):
        raise ChatInputError("each content part must be a string or an object")
    kind = part.get("type")
    if kind is None:
        raise ChatInputError("Missing 'type' field in multimodal part.")
    if not isinstance(kind, str):
        raise ChatInputError("Invalid 'type' field in multimodal part.")
    if kind in TEXT_PART_TYPES:
        text = part.get(_PART_FIELD.get(kind, "text"))
        if text is None:
            return None
        if not isinstance(text, str):
            raise ChatInputError(f"a {kind} content part needs a string")
        return text
    raise UnsupportedContent(
        f"content part type {kind!r} needs a multimodal model; this tokenizer renders text only"
    )


def _content(content: Any, fmt: ContentFormat) -> str | list[dict[str, str]]:
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [content]
    elif isinstance(content, list):
        parts = content
    else:
        raise ChatInputError("message content must be a string, null or a list of parts")
    texts = [text for text in map(_part_text, parts) if text is not None]
    if fmt == "openai":
        return [{"type": "text", "text": text} for text in texts]
    return "\n".join(texts)


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return {}
    return value if isinstance(value, dict | list) else {}


def _tool_calls(calls: Any) -> list[Any] | None:
    if not isinstance(calls, list):
        raise ChatInputError("'tool_calls' must be a list")
    if not calls:
        return None
    out: list[Any] = []
    for call in calls:
        if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
            raise ChatInputError("each tool call needs a 'function' object")
        item = copy.deepcopy(dict(call))
        item["function"]["arguments"] = _arguments(item["function"].get("arguments"))
        out.append(item)
    return out


def conversation(
    messages: Sequence[Any], fmt: ContentFormat
) -> list[dict[str, Any]]:
    """The messages as vLLM passes them to the template (see the module docstring)."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise ChatInputError("'messages' must be a list")
    out: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ChatInputError("each message must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatInputError("each message needs a string 'role'")
        item: dict[str, Any] = {"role": role, "content": _content(message.get("content"), fmt)}
        if role == "assistant":
            calls = message.get("tool_calls")
            if calls is not None:
                parsed = _tool_calls(calls)
                if parsed is not None:
                    item["tool_calls"] = parsed
            reasoning = message.get("reasoning")
            if reasoning is not None:
                item["reasoning"] = reasoning
                item["reasoning_content"] = reasoning
        elif role == "tool":
            if "tool_call_id" in message:
                item["tool_call_id"] = message["tool_call_id"]
            if isinstance(item["content"], list):
                item["content"] = "\n".join(part["text"] for part in item["content"])
        if isinstance(message.get("name"), str):
            item["name"] = message["name"]
        if isinstance(message.get("task"), str):
            item["task"] = message["task"]
        if role == "developer":
            item["tools"] = message.get("tools")
        out.append(item)
    return out


def tool_schemas(tools: Any) -> list[dict[str, Any]] | None:
    """`tools` as vLLM dumps them for the template (absent fields as null)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ChatInputError("'tools' must be a list")
    out: list[dict[str, Any]] = []
    for tool in tools:
        if not isinstance(tool, Mapping) or not isinstance(tool.get("function"), Mapping):
            raise ChatInputError("each tool needs a 'function' object")
        function = tool["function"]
        if not isinstance(function.get("name"), str):
            raise ChatInputError("each tool function needs a string 'name'")
        fields = ("name", "description", "parameters", "strict")
        dumped_function = {name: copy.deepcopy(function.get(name)) for name in fields}
        dumped_function.update(
            {k: copy.deepcopy(v) for k, v in function.items() if k not in fields}
        )
        dumped = {"type": tool.get("type", "function"), "function": dumped_function}
        dumped.update(
            {k: copy.deepcopy(v) for k, v in tool.items() if k not in ("type", "function")}
        )
        out.append(dumped)
    return out
