"""`tokenizer_config.json` (plus the template files next to it), read as `transformers` reads it.

What matters for token parity:

- named special tokens (`bos_token`, `eos_token`, `unk_token`, `sep_token`, `pad_token`,
  `cls_token`, `mask_token`): a string or an AddedToken object `{"content": ...}`; the
  chat template sees them as variables (transformers' `special_tokens_map`);
- `add_bos_token` / `add_eos_token`: read, but, as transformers v5 does when a
  `tokenizer.json` exists, not applied (its post-processor decides, `tokenizer.py`);
- chat templates: `chat_template` is a string or a list of `{"name", "template"}`; a
  `chat_template.jinja` file next to it replaces the default one and
  `additional_chat_templates/<name>.jinja` add named ones, as transformers loads them;
- `model_max_length`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

SPECIAL_TOKEN_NAMES: Final = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
CONFIG_FILE: Final = "tokenizer_config.json"
TEMPLATE_FILE: Final = "chat_template.jinja"
ADDITIONAL_TEMPLATES_DIR: Final = "additional_chat_templates"
DEFAULT_TEMPLATE_NAME: Final = "default"


class TokenizerConfigError(ValueError):
    """A `tokenizer_config.json` that cannot be used."""


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _templates(raw: Any) -> dict[str, str]:
    if raw is None:
        return {}
    if isinstance(raw, str):
        return {DEFAULT_TEMPLATE_NAME: raw}
    if isinstance(raw, list):
        out: dict[str, str] = {}
        for item in raw:
            if not (
                isinstance(item, Mapping)
                and isinstance(item.get("name"), str)
                and isinstance(item.get("template"), str)
            ):
                raise TokenizerConfigError("chat_template list items need 'name' and 'template'")
            out[item["name"]] = item["template"]
        return out
    raise TokenizerConfigError("chat_template must be a string or a list of named templates")


@dataclass(frozen=True, slots=True)
class TokenizerConfig:
    """The parts of `tokenizer_config.json` that change tokens (see the module docstring)."""

    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token -> text, ...
    add_bos_token: bool | None = None  # None: key absent (keep tokenizer.json's processor)
    add_eos_token: bool | None = None
    chat_templates: dict[str, str] = field(default_factory=dict)  # name -> Jinja source
    model_max_length: int | None = None

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> TokenizerConfig:
        special = {
            name: text
            for name in SPECIAL_TOKEN_NAMES
            if (text := _token_text(raw.get(name))) is not None
        }
        max_len = raw.get("model_max_length")
        return cls(
            special_tokens=special,
            add_bos_token=None if "add_bos_token" not in raw else bool(raw["add_bos_token"]),
            add_eos_token=None if "add_eos_token" not in raw else bool(raw["add_eos_token"]),
            chat_templates=_templates(raw.get("chat_template")),
            model_max_length=max_len if isinstance(max_len, int) and max_len > 0 else None,
        )

    @classmethod
    def from_dir(cls, directory: Path) -> TokenizerConfig:
        """Read `tokenizer_config.json` (optional) and the template files of `directory`."""
        path = directory / CONFIG_FILE
        raw: Any = {}
        if path.is_file():
            try:
                raw = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise TokenizerConfigError(f"{path}: {exc}") from exc
            if not isinstance(raw, dict):
                raise TokenizerConfigError(f"{path}: not a JSON object")
        config = cls.from_mapping(raw)
        templates = dict(config.chat_templates)
        jinja = directory / TEMPLATE_FILE
        if jinja.is_file():
            templates[DEFAULT_TEMPLATE_NAME] = jinja.read_text(encoding="utf-8")
        extra = directory / ADDITIONAL_TEMPLATES_DIR
        if extra.is_dir():
            for file in sorted(extra.glob("*.jinja")):
                templates[file.stem] = file.read_text(encoding="utf-8")
        return cls(
            config.special_tokens, config.add_bos_token, config.add_eos_token, templates,
            config.model_max_length,
        )

    def template_source(self, tools: Any = None) -> str | None:
        """The template transformers' `get_chat_template` picks: `tool_use` when tools are
        given and one exists, else `default`; a lone unnamed template is the default."""
        templates = self.chat_templates
        if not templates:
            return None
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        if DEFAULT_TEMPLATE_NAME in templates:
            return templates[DEFAULT_TEMPLATE_NAME]
        raise TokenizerConfigError(
            "this model has several chat templates and none is named 'default': "
            f"{sorted(templates)}"
        )
