"""Tokenizing a prompt (plain or through the model's chat template) and reading ids back as text."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

from tracer.core.errors import TracerError, one_line

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["chat_text", "chat_tokens", "check_prompt", "detokenize", "tokenize", "tokenize_plain"]

TOKENIZER_FILE = "tokenizer.json"


def tokenize(model_dir: str | os.PathLike, prompt: str) -> list[int]:
    """Token ids of ``prompt`` exactly as the HF tokenizer gives them (special tokens included)."""
    check_prompt(prompt)
    tokenizer = _tokenizer(model_dir)
    if tokenizer is None:
        raise TracerError(f"model {model_dir} has no tokenizer.json; pass token ids with --tokens")
    ids = tokenizer.encode(prompt, add_special_tokens=True).ids
    if not ids:
        raise TracerError(f"prompt gives no tokens: {prompt!r}")
    return list(ids)


def tokenize_plain(model_dir: str | os.PathLike, text: str) -> tuple[list[int], int | None]:
    """Token ids of a text as llama.cpp's `common_tokenize(ctx, text, add_special=true,
    parse_special=false)` gives them (what llama-perplexity reads): the tokenizer's own special
    tokens added, special-token text inside `text` read as plain text; and the id of the BOS the
    tokenizer puts in front (None: it adds none).
    """
    check_prompt(text)
    path = Path(model_dir).expanduser().resolve() / TOKENIZER_FILE
    if not path.is_file():
        raise TracerError(f"model {model_dir} has no tokenizer.json; pass token ids instead of a text")
    try:
        tokenizer = Tokenizer.from_file(str(path))  # a copy of its own: the setting below is not shared
    except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception on bad files
        raise TracerError(f"cannot read tokenizer {path}: {one_line(exc)}") from exc
    tokenizer.encode_special_tokens = True  # parse_special=false
    ids = tokenizer.encode(text, add_special_tokens=True).ids
    plain = tokenizer.encode(text, add_special_tokens=False).ids
    if ids == plain:
        return list(ids), None
    if ids[1:] == plain:
        return list(ids), ids[0]
    raise TracerError(f"the tokenizer of {model_dir} adds more than a BOS in front of a text (an EOS?); "
                      "llama-perplexity refuses vocabularies that add an EOS")


def chat_text(model_dir: str | os.PathLike, prompt: str, system: str | None = None) -> str:
    """The prompt as an instruct model is fed it: the model's chat template applied to one user
    message (after `system`, if given), ending with the assistant's turn, as transformers'
    `apply_chat_template(..., add_generation_prompt=True)` renders it.

    Raises:
        TracerError: the model has no chat template.
    """
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # jinja2: 30 ms, for chat templates only

    check_prompt(prompt)
    template, special = _chat_template(Path(model_dir))
    messages = ([{"role": "system", "content": system}] if system is not None else []) + \
        [{"role": "user", "content": prompt}]

    def raise_exception(message):
        raise TracerError(f"the chat template of {model_dir} refuses this conversation: {message}")

    # transformers renders with these options and this sandbox (utils/chat_template_utils.py)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, **special)


def chat_tokens(model_dir: str | os.PathLike, text: str) -> list[int]:
    """Token ids of an already templated text: the template wrote the special tokens itself."""
    tokenizer = _tokenizer(model_dir)
    if tokenizer is None:
        raise TracerError(f"model {model_dir} has no tokenizer.json; pass token ids with --tokens")
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


def _chat_template(model_dir: Path) -> tuple[str, dict[str, str]]:
    """(template, special tokens it may name) from chat_template.jinja or tokenizer_config.json."""
    config_path = model_dir / "tokenizer_config.json"
    try:
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    except (OSError, ValueError) as exc:
        raise TracerError(f"cannot read {config_path}: {exc}") from None
    special = {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, str)}
    template_file = model_dir / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8"), special
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if not isinstance(template, str):
        raise TracerError(f"model {model_dir} has no chat template (chat_template.jinja or tokenizer_config.json)")
    return template, special


def check_prompt(prompt: str) -> None:
    """An empty or whitespace-only prompt is almost always an unset shell variable, not a choice;
    whoever means to trace bare whitespace can pass its token ids."""
    if not isinstance(prompt, str):
        raise TracerError(f"the prompt must be text, got {type(prompt).__name__}")
    if not prompt.strip():
        raise TracerError("empty prompt" if not prompt else f"the prompt is only whitespace ({prompt!r}); "
                          "pass token ids to trace whitespace")


def detokenize(model_dir: str | os.PathLike, ids: Iterable[int]) -> str | None:
    """Text of ``ids`` (special tokens kept, they matter when reading a trace); None without a tokenizer."""
    tokenizer = _tokenizer(model_dir)
    if tokenizer is None:
        return None
    return tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def _tokenizer(model_dir: str | os.PathLike) -> Tokenizer | None:
    path = Path(model_dir).expanduser().resolve() / TOKENIZER_FILE
    try:
        mtime = path.stat().st_mtime_ns
    except FileNotFoundError:
        return None
    # mtime in the key: a re-converted model must not keep yesterday's tokenizer.
    return _load_tokenizer(str(path), mtime)


@functools.lru_cache(maxsize=8)
def _load_tokenizer(path: str, mtime_ns: int) -> Tokenizer:
    # Loaded directly with `tokenizers` (no transformers): the reimpl engine must not import it,
    # and greedy decoding calls detokenize once per step, hence the cache.
    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception on bad files
        raise TracerError(f"cannot read tokenizer {path}: {one_line(exc)}") from exc
