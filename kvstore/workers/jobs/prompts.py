"""Prompt requests to token ids: one JSON object per request, from a file or over HTTP.

A request gives exactly one of ``token_ids`` (used as they are), ``text`` (encoded with the
model's tokenizer) or ``messages`` (a chat, rendered with the checkpoint's chat template and
the assistant's turn opened). The jobs read them from a JSONL file; a server parses each body
with the same ``parse_prompt_line``, so both accept and refuse exactly the same requests.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvstore.errors import ConfigError
from kvstore.workers.model.tokenizer import Tokenizer

#: The keys of which a request gives exactly one.
PROMPT_KEYS = ("token_ids", "text", "messages")


def parse_prompt_line(obj: object, tokenizer: Tokenizer, where: str
                      ) -> tuple[str | None, list[int]]:
    """``(id or None, token_ids)`` of one request; ``where`` (``"p.jsonl:3"``) leads every
    error, so a bad line in a long file is found at once."""
    given = [k for k in PROMPT_KEYS if isinstance(obj, dict) and k in obj]
    if not isinstance(obj, dict) or len(given) != 1:
        raise ConfigError(f"{where}: give exactly one of 'token_ids', 'text' or 'messages'")
    prompt_id = str(obj["id"]) if "id" in obj else None
    if "text" in obj:
        return prompt_id, tokenizer.encode(str(obj["text"]))
    if "messages" in obj:
        try:
            return prompt_id, tokenizer.apply_chat_template(obj["messages"])
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    ids = obj["token_ids"]
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise ConfigError(f"{where}: 'token_ids' must be a list of ints")
    return prompt_id, ids


def read_prompts(path: str, tokenizer: Tokenizer) -> list[tuple[str, list[int]]]:
    """``(id, token_ids)`` per line (the id defaults to the line number); the line number is in
    every error."""
    out = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read --prompts {path}: {exc}") from exc
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{n}: not JSON ({exc.msg})") from None
        prompt_id, ids = parse_prompt_line(obj, tokenizer, f"{path}:{n}")
        out.append((str(n) if prompt_id is None else prompt_id, ids))
    if not out:
        raise ConfigError(f"--prompts {path} has no requests")
    return out
