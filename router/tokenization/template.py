"""A model's Jinja chat template, rendered as `transformers.apply_chat_template` renders it.

Environment (as transformers builds it): an `ImmutableSandboxedEnvironment` with
`trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension and the `{% generation %}`
tag (rendered as its body); `tojson` dumps like `json.dumps` (no HTML escaping,
`ensure_ascii=False`, optional `indent`/`separators`/`sort_keys`); globals
`raise_exception(msg)`, `strftime_now(fmt)`, `dict(...)` and a `namespace` that refuses
underscore attributes.

Variables: `messages`, `tools`, `documents`, `add_generation_prompt`, the named special
tokens (`bos_token`, `eos_token`, ...) and every extra keyword (vLLM's
`chat_template_kwargs`), extra keywords overriding the special tokens. Message keys whose
value is None are dropped first, and a message's reasoning (`reasoning_content`,
`thinking` or `reasoning`) is copied under `thinking` and `reasoning_content`.

`continue_final_message`: a tag is appended to the final message's content (to the last
text part when the content is a list), the chat is rendered, and the text is cut where the
tag starts (after an `rstrip` when the template trimmed the spacing after the content), so
the final message stays open.

`content_format` is what vLLM detects to decide whether a message's `content` reaches the
template as a string (`"string"`) or as a list of parts (`"openai"`): "openai" when the
template loops over a message's `content` (`{% for part in message['content'] %}`, also
through variables assigned from `messages` or from one message), else "string".
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, Final, Literal

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

ContentFormat = Literal["string", "openai"]
CONTINUE_TAG: Final = "CONTINUE_FINAL_MESSAGE_TAG "
_REASONING_FIELDS: Final = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """A chat that the template cannot render (or a template that does not compile)."""


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers' assistant-mask tag."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
        sort_keys=sort_keys,
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's own signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore attributes on a namespace: {name!r}"
            )


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env


# -- vLLM's content-format detection ---------------------------------------------------------


def _is_var(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _is_item(node: jinja2.nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        arg = node.arg
        return _is_var(node.node, name) and isinstance(arg, jinja2.nodes.Const) and (
            arg.value == key
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _reads(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """`node` reads `name` (or `name[key]`), possibly through filters, tests or a slice."""
    if isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _reads(node.node, name, key)
    return _is_item(node, name, key) if key else _is_var(node, name)


def _aliases(root: jinja2.nodes.Template, name: str) -> list[str]:
    """`name` and every variable assigned (transitively) from it."""
    found = [name]
    queue = [name]
    while queue:
        current = queue.pop(0)
        for assign in root.find_all(jinja2.nodes.Assign):
            target = assign.target
            if isinstance(target, jinja2.nodes.Name) and _reads(assign.node, current):
                if target.name not in found:
                    found.append(target.name)
                    queue.append(target.name)
    return found


def _loop_targets(
    root: jinja2.nodes.Template, sources: list[str], key: str | None
) -> Iterator[str]:
    for loop in root.find_all(jinja2.nodes.For):
        if isinstance(loop.target, jinja2.nodes.Name) and any(
            _reads(loop.iter, source, key) for source in sources
        ):
            yield loop.target.name


def detect_content_format(ast: jinja2.nodes.Template) -> ContentFormat:
    """vLLM's "auto" content format of a parsed template (see the module docstring)."""
    message_vars = list(_loop_targets(ast, _aliases(ast, "messages"), None))
    for _ in _loop_targets(ast, message_vars, "content"):
        return "openai"
    return "string"


# -- rendering ----------------------------------------------------------------------------------


def _prepare_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    chat: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ChatTemplateError("chat messages must be objects")
        item = {key: value for key, value in message.items() if value is not None}
        reasoning = next(
            (item[key] for key in _REASONING_FIELDS if item.get(key) is not None), None
        )
        if reasoning is not None:
            item = {"thinking": reasoning, **item, "reasoning_content": reasoning}
        chat.append(item)
    return chat


class ChatTemplate:
    """One compiled chat template. Immutable after construction; safe to share."""

    __slots__ = ("_template", "content_format", "source", "variables")

    def __init__(self, source: str) -> None:
        env = _environment()
        try:
            ast = env.parse(source)
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from exc
        self.source = source
        self.variables: frozenset[str] = frozenset(jinja2.meta.find_undeclared_variables(ast))
        self.content_format: ContentFormat = detect_content_format(ast)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        special_tokens: Mapping[str, str] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text; raises `ChatTemplateError` on any template failure."""
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError(
                "continue_final_message and add_generation_prompt are not compatible"
            )
        chat = _prepare_messages(messages)
        final_text = ""
        if continue_final_message:
            final_text = self._tag_final_message(chat)
        variables: dict[str, Any] = {**(special_tokens or {}), **(extra or {})}
        variables.update(
            messages=chat,
            tools=None if tools is None else list(tools),
            documents=None if documents is None else list(documents),
            add_generation_prompt=add_generation_prompt,
        )
        try:
            rendered = self._template.render(**variables)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(str(exc)) from exc
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise ChatTemplateError(f"the chat template failed: {exc}") from exc
        if continue_final_message:
            rendered = self._cut_at_tag(rendered, final_text)
        return rendered

    def _tag_final_message(self, chat: list[dict[str, Any]]) -> str:
        if not chat:
            raise ChatTemplateError("continue_final_message is set but the chat is empty")
        if "content" not in self.source:
            raise ChatTemplateError("continue_final_message: the template reads no 'content'")
        final = chat[-1].get("content")
        if final is None:
            raise ChatTemplateError("continue_final_message: the final message has no content")
        if isinstance(final, list | tuple):
            parts = [dict(p) if isinstance(p, Mapping) else p for p in final]
            for part in reversed(parts):
                if isinstance(part, dict) and "text" in part:
                    text = str(part["text"])
                    part["text"] = text + CONTINUE_TAG
                    chat[-1] = {**chat[-1], "content": parts}
                    return text
            raise ChatTemplateError("continue_final_message: no text to continue")
        text = str(final)
        chat[-1] = {**chat[-1], "content": text + CONTINUE_TAG}
        return text

    @staticmethod
    def _cut_at_tag(rendered: str, final_text: str) -> str:
        tag = CONTINUE_TAG.strip()
        if final_text.strip() not in rendered or tag not in rendered:
            raise ChatTemplateError(
                "continue_final_message: the final message does not appear in the rendered chat"
            )
        at = rendered.rindex(tag)
        if rendered[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG:
            return rendered[:at]
        return rendered[:at].rstrip()
