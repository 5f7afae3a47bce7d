"""Text to token ids: a local tokenizer directory, or bytes for the random-weight presets."""

from __future__ import annotations

import os
from typing import Protocol

from kvstore.errors import ConfigError


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, token_ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255: no files needed, fits every preset's vocabulary."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        # Random weights produce ids above 255 too; they have no byte, so they are dropped.
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A transformers tokenizer loaded from a local directory (no download)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        if not os.path.isdir(path):
            raise ConfigError(f"--tokenizer {path!r} is not a directory with tokenizer files")
        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot load a tokenizer from {path!r}: {exc}") from exc

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def decode(self, token_ids: list[int]) -> str:
        return str(self._tok.decode(token_ids, skip_special_tokens=True))


def load_tokenizer(path: str | None) -> Tokenizer:
    """The tokenizer at ``path``, or the byte-level one when there is none."""
    return HFTokenizer(path) if path else ByteTokenizer()
