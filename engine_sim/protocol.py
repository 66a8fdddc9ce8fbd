"""Reading OpenAI request bodies into what the engine needs, with vLLM's validation errors."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from engine_sim.prompts import PromptTokenizer
from router.tokenization import ChatInputError, UnsupportedContent
from router.tokenization.messages import conversation

Endpoint = Literal["chat", "completion"]


class RequestError(Exception):
    """A request vLLM would refuse; rendered as its nested error JSON with `status`."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        err_type: str = "BadRequestError",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type
        self.param = param


@dataclass(frozen=True, slots=True)
class Limits:
    """What the served model accepts."""

    model: str
    max_model_len: int
    default_max_tokens: int
    #: LoRA adapters served besides the model (`--lora-modules`), numbered from 1 in order.
    lora_names: tuple[str, ...] = ()

    def serves(self, model: str) -> bool:
        return model == self.model or model in self.lora_names

    def lora(self, model: str) -> tuple[str, int] | None:
        """The adapter `model` names, with its number (vLLM's `lora_int_id`), or None."""
        if model == self.model or model not in self.lora_names:
            return None
        return model, self.lora_names.index(model) + 1


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    endpoint: Endpoint
    model: str
    token_ids: tuple[int, ...]
    max_tokens: int
    min_tokens: int
    stream: bool
    include_usage: bool
    cache_salt: str | None
    priority: int
    kv_transfer_params: Any
    body: Mapping[str, Any] = field(repr=False)
    #: The adapter the request names (name, number), as vLLM's `LoRARequest`.
    lora: tuple[str, int] | None = None
    #: `echo`: the text the answer starts with (a completion's prompt; a chat's last
    #: message when it has the answer's role), None without echo.
    echo_text: str | None = None
    #: A chat answer's role (vLLM's `get_chat_request_role`): "assistant", or the last
    #: message's own with `add_generation_prompt: false`.
    role: str = "assistant"
    #: A completion with `echo` and `max_tokens: 0` (vLLM's `echo_without_generation`):
    #: the engine still generates one token (`max_tokens` is 1), the answer shows the
    #: prompt alone.
    echo_only: bool = False

    @property
    def lora_name(self) -> str | None:
        return None if self.lora is None else self.lora[0]


def _optional_int(body: Mapping[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise RequestError(f"'{name}' must be an integer >= {minimum}", param=name)
    return value


def _prompt_tokens(
    body: Mapping[str, Any], endpoint: Endpoint, tokenizer: PromptTokenizer
) -> tuple[int, ...]:
    try:
        prompts = tokenizer.request_ids(endpoint, body)
    except UnsupportedContent as exc:
        raise RequestError(str(exc), param="messages") from exc
    except ChatInputError as exc:
        raise RequestError(str(exc), param="messages" if endpoint == "chat" else "prompt") from exc
    if len(prompts) != 1:
        raise RequestError(
            "'prompt' must be a string, a list of token ids, or a list of one of those "
            "(the simulator serves one prompt per request)",
            param="prompt",
        )
    ids = prompts[0]
    highest = max(ids, default=0)
    if highest > tokenizer.max_token_id:  # vLLM's `_validate_model_input`: a 400
        raise RequestError(f"Token id {highest} is out of vocabulary", param="prompt")
    return ids


def check_model(model: object, limits: Limits) -> str:
    """The model a request names (the served one when it names none), or vLLM's 404."""
    if model is None:
        return limits.model
    if not (isinstance(model, str) and limits.serves(model)):
        raise RequestError(
            f"The model `{model}` does not exist.", 404, "NotFoundError", param="model"
        )
    return model


def parse_request(
    body: Any, endpoint: Endpoint, tokenizer: PromptTokenizer, limits: Limits
) -> ParsedRequest:
    """Validate a chat or completion body and tokenize its prompt."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    model = check_model(body.get("model"), limits)
    if endpoint == "chat":
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise RequestError("'messages' must be a non-empty list", param="messages")
        token_ids = _prompt_tokens(body, endpoint, tokenizer)
        max_tokens = _optional_int(body, "max_completion_tokens", 1)
        if max_tokens is None:
            max_tokens = _optional_int(body, "max_tokens", 1)
    else:
        token_ids = _prompt_tokens(body, endpoint, tokenizer)
        max_tokens = _optional_int(body, "max_tokens", 0 if body.get("echo") is True else 1)
    if not token_ids:
        raise RequestError("the prompt is empty", param="prompt")
    role = _answer_role(body) if endpoint == "chat" else "assistant"
    echo_text = _echo_text(body, endpoint, token_ids, tokenizer, role)
    echo_only = echo_text is not None and max_tokens == 0
    if echo_only:
        max_tokens = 1  # vLLM's to_sampling_params: one token generated, none shown
    if max_tokens is None:
        max_tokens = limits.default_max_tokens
    min_tokens = _optional_int(body, "min_tokens", 0) or 0
    if min_tokens > max_tokens:
        raise RequestError(
            f"min_tokens ({min_tokens}) must be less than or equal to max_tokens ({max_tokens})",
            param="min_tokens",
        )
    if len(token_ids) + max_tokens > limits.max_model_len:
        raise RequestError(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, "
            f"you requested {len(token_ids) + max_tokens} tokens ({len(token_ids)} in the "
            f"messages, {max_tokens} in the completion). Please reduce the length of the "
            "messages or completion.",
            param="max_tokens",
        )
    stream = body.get("stream") is True
    options = body.get("stream_options")
    include_usage = stream and isinstance(options, dict) and options.get("include_usage") is True
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise RequestError("'cache_salt' must be a non-empty string", param="cache_salt")
    priority = body.get("priority", 0)
    return ParsedRequest(
        endpoint=endpoint,
        model=model,
        token_ids=token_ids,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stream=stream,
        include_usage=include_usage,
        cache_salt=salt,
        priority=priority if isinstance(priority, int) else 0,
        kv_transfer_params=body.get("kv_transfer_params"),
        body=body,
        lora=limits.lora(model),
        role=role,
        echo_text=echo_text,
        echo_only=echo_only,
    )


def _answer_role(body: Mapping[str, Any]) -> str:
    """vLLM's `get_chat_request_role`: the response role ("assistant") when the template
    adds a generation prompt, else the last message's role."""
    if body.get("add_generation_prompt", True) is not False:
        return "assistant"
    role = body["messages"][-1].get("role") if isinstance(body["messages"][-1], dict) else None
    return role if isinstance(role, str) and role else "assistant"


def _echo_text(
    body: Mapping[str, Any], endpoint: Endpoint, token_ids: tuple[int, ...],
    tokenizer: PromptTokenizer, role: str,
) -> str | None:
    """What `echo: true` puts before the answer, as vLLM's serving code: a completion's
    prompt (its text, or its token ids decoded); for a chat, the last message's content
    when its role is the answer's `role`, its text parts joined by newlines as vLLM parses
    them (`router.tokenization.messages`)."""
    if body.get("echo") is not True:
        return None
    if endpoint == "completion":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        return prompt if isinstance(prompt, str) else tokenizer.decode(token_ids)
    last = conversation(body["messages"][-1:], "string")[-1]
    content = last.get("content")
    if last["role"] != role or not isinstance(content, str) or not content:
        return None
    return content
