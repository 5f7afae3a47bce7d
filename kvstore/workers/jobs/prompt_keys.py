"""The block keys a worker would publish for a prompt, for ``kvstore pin|unpin|invalidate``.

An operator names a system prompt, not 64-digit keys. The keys depend on the model's
fingerprint (its config and weights), the dtype, the block size, the tenant salt and, for an
approximate reuse policy, a salt suffix of the engine's own: so they are computed by the
worker's own code (the model loader and ``Engine``), never re-derived here, and a pin by prompt
names exactly the blocks a prefill of that prompt publishes.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.config import KVStoreConfig
from kvstore.errors import ConfigError
from kvstore.keys import BlockHasher, BlockKey, Namespace
from kvstore.security.data_keys import parse_data_key


@dataclass(slots=True)
class PromptBlocks:
    """One prompt's full blocks: ``num_tokens`` tokens, the keys of its full blocks."""

    prompt_id: str
    num_tokens: int
    keys: list[BlockKey]


def worker_namespace(config: KVStoreConfig) -> Namespace:
    """The namespace a worker with ``config.worker`` publishes in (loads the model once)."""
    from kvstore.workers.engine.prefill_decode import Engine
    from kvstore.workers.model.causal_lm import load_worker_model

    wc = config.worker
    model = load_worker_model(wc)
    return Engine(model, None, wc, data_key=parse_data_key(config.security.data_key)).namespace


def read_prompt_tokens(prompts_path: str | None, text: str | None,
                       tokenizer_path: str | None, model: str = "tiny"
                       ) -> list[tuple[str, list[int]]]:
    """``(id, token_ids)`` from a prompts file (as the jobs read it) or one ``--text``.

    Tokenized as the workers of ``model`` tokenize (its directory's own tokenizer by default),
    so the keys are the ones the jobs and the HTTP server publish.
    """
    from kvstore.workers.jobs.prompts import read_prompts
    from kvstore.workers.model.tokenizer import tokenizer_for

    tokenizer = tokenizer_for(model, tokenizer_path)
    if text is not None:
        return [("--text", tokenizer.encode(text))]
    if prompts_path is None:
        raise ConfigError("give --prompts FILE.jsonl or --text TEXT")
    return read_prompts(prompts_path, tokenizer)


def prompt_blocks(namespace: Namespace, prompts: list[tuple[str, list[int]]]
                  ) -> list[PromptBlocks]:
    """Each prompt's full-block keys in ``namespace``; a prompt shorter than a block is an
    error (it has no block to pin, and silently pinning nothing hides a wrong file)."""
    hasher = BlockHasher(namespace)
    out = []
    for prompt_id, ids in prompts:
        if len(ids) < namespace.block_size:
            raise ConfigError(f"prompt {prompt_id!r} has {len(ids)} tokens, fewer than one "
                              f"block ({namespace.block_size}): it has no cached blocks")
        out.append(PromptBlocks(prompt_id, len(ids), hasher.block_keys(ids)))
    return out


def unique_keys(blocks: list[PromptBlocks]) -> list[bytes]:
    """Every prompt's keys once, in chain order (prompts sharing a prefix share its keys)."""
    seen: dict[bytes, None] = {}
    for b in blocks:
        seen.update(dict.fromkeys(b.keys))
    return list(seen)
