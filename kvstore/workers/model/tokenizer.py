"""Text and chat messages to token ids: the checkpoint's own tokenizer, or bytes for presets.

A real checkpoint fed ids from another tokenizer computes on nonsense without any error, so
the tokenizer follows the model: an explicit ``--tokenizer`` wins, else a model directory's own
tokenizer files, else (random-weight presets only) UTF-8 bytes. A model directory without
tokenizer files is refused rather than silently given bytes.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

from kvstore.errors import ConfigError

#: Files any of which make a directory a tokenizer directory (fast, slow or sentencepiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

#: Roles a prompt's messages may have.
ROLES = ("system", "user", "assistant")


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, token_ids: list[int]) -> str: ...
    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """The messages rendered as the model expects, ending with the assistant's turn."""
        ...


def check_messages(messages: object) -> list[dict[str, str]]:
    """``messages`` as a list of ``{"role", "content"}`` dicts, or a ConfigError naming what is
    wrong: the templates index both keys, and a wrong type there fails deep inside Jinja."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError("'messages' must be a non-empty list of {\"role\", \"content\"} "
                          "objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ConfigError(f"'messages'[{i}] must be an object with 'role' and 'content'")
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise ConfigError(f"'messages'[{i}] has unknown keys {extra}; only 'role' and "
                              "'content' are accepted")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ConfigError(f"'messages'[{i}]: 'role' must be one of {', '.join(ROLES)}, "
                              f"got {role!r}")
        if not isinstance(content, str):
            raise ConfigError(f"'messages'[{i}]: 'content' must be a string, got "
                              f"{type(content).__name__}")
        out.append({"role": role, "content": content})
    return out


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255: no files needed, fits every preset's vocabulary.

    Its chat template is built in, so presets take ``messages`` too: ``<|role|>\\ncontent\\n``
    per message, then ``<|assistant|>\\n`` (plain bytes; random weights know no template).
    """

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        # Random weights produce ids above 255 too; they have no byte, so they are dropped.
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in check_messages(messages))
        return self.encode(text + "<|assistant|>\n")


class HFTokenizer:
    """A transformers tokenizer loaded from a local directory (no download)."""

    def __init__(self, path: str, flag: str = "--tokenizer") -> None:
        from transformers import AutoTokenizer

        if not os.path.isdir(path):
            raise ConfigError(f"{flag} {path!r} is not a directory with tokenizer files")
        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot load a tokenizer from {path!r}: {exc}") from exc
        self.path = path

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def decode(self, token_ids: list[int]) -> str:
        return str(self._tok.decode(token_ids, skip_special_tokens=True))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        checked = check_messages(messages)
        if not getattr(self._tok, "chat_template", None):
            raise ConfigError(f"the checkpoint's tokenizer at {self.path!r} has no chat "
                              "template: give 'text' or 'token_ids' instead of 'messages'")
        # transformers' return type covers every combination of options; these give ids.
        ids: Any = self._tok.apply_chat_template(checked, add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
        return [int(t) for t in ids]


def has_tokenizer_files(path: str) -> bool:
    """Whether ``path`` is a directory holding any tokenizer file."""
    return any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES)


def tokenizer_for(model: str, tokenizer_path: str | None) -> Tokenizer:
    """The tokenizer for ``--model model`` (see the module docstring for the order)."""
    from kvstore.workers.model.causal_lm import PRESETS

    if tokenizer_path:
        return HFTokenizer(tokenizer_path)
    if model in PRESETS:
        return ByteTokenizer()
    if not os.path.isdir(model):
        raise ConfigError(f"--model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a "
                          "local weights directory (with config.json and *.safetensors)")
    if not has_tokenizer_files(model):
        raise ConfigError(f"model directory {model!r} has no tokenizer files "
                          f"({', '.join(TOKENIZER_FILES)}): pass --tokenizer DIR with the "
                          "checkpoint's tokenizer")
    return HFTokenizer(model, flag="--model")


def load_tokenizer(path: str | None) -> Tokenizer:
    """The tokenizer at ``path``, or the byte-level one when there is none (no model known:
    prefer ``tokenizer_for``, which follows the model)."""
    return HFTokenizer(path) if path else ByteTokenizer()
