"""A small published-style checkpoint built offline: Llama weights, a trained BPE tokenizer.

Real checkpoints come as a transformers directory: ``config.json``, safetensors weights,
``generation_config.json`` (whose ``eos_token_id`` ends generation) and the tokenizer's own
files with a chat template. Tests of "load a real checkpoint" need exactly that shape without a
download, so this builds one in-process: random weights shaped like the ``tiny`` preset and a
byte-level BPE tokenizer trained on a built-in corpus (any text encodes, ids are not bytes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

#: Special tokens, in id order from 0: what a Llama-style chat checkpoint declares.
SPECIAL_TOKENS = ("<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>")

#: A checkpoint-style template: ``<s>``, then ``<|role|>\ncontent</s>\n`` per message, then
#: ``<|assistant|>\n`` when a generation prompt is asked for.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_CORPUS = """
The store keeps the key and value tensors of every prompt block so that a second request
with the same system prompt starts from the cache instead of computing it again. A worker
prefills the prompt in chunks, publishes each full block, and a decode worker fetches the
blocks it needs, checks them, and generates the answer one token at a time. When a block is
missing the worker simply computes it; the result is the same either way, bit for bit.
Hello there! How are you today? I am fine, thank you. What is the weather like in the city?
It is sunny and warm, with a light wind from the west. Please tell me a short story about a
small robot who learns to paint. Once upon a time, a little robot found a box of colours in
an old house near the river. It painted the sky, the trees, the water and the people who
walked by. Everyone smiled, and the robot was happy. The end. Can you explain how a cache
works? A cache is a small fast memory that holds recent results, so the next question that
needs them can answer quickly. Numbers like 1, 2, 3, 42 and 2026 appear in text too, as do
names such as Alice, Bob and Carol, and words such as model, token, layer, head and block.
You are a helpful assistant. Answer briefly and clearly. Thank you for your help, goodbye!
"""


def train_tokenizer(vocab_size: int = 400) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on the built-in corpus (milliseconds)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS.split("\n"), trainer=trainer)
    bos = tok.token_to_id("<s>")
    # Like Llama's: encoding a text puts <s> first (a chat template writes its own).
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    return tok


def build_checkpoint(path: Path, *, seed: int = 0, eos_token_id: int | None = None,
                     chat_template: bool = True, with_tokenizer: bool = True,
                     config_overrides: dict[str, Any] | None = None) -> Path:
    """Write a checkpoint directory at ``path`` and return it.

    ``eos_token_id``: the ``generation_config.json`` stop token (default: the ``</s>`` id,
    which ``config.json`` names as well). ``chat_template=False`` leaves the tokenizer without
    one; ``with_tokenizer=False`` writes weights only. ``config_overrides`` go into the
    ``LlamaConfig`` (e.g. ``layer_types``, ``sliding_window``).
    """
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    raw = train_tokenizer()
    bos, eos = raw.token_to_id("<s>"), raw.token_to_id("</s>")
    fields: dict[str, Any] = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=176, vocab_size=raw.get_vocab_size(), max_position_embeddings=4096,
        initializer_range=0.08, bos_token_id=bos, eos_token_id=eos)
    config = LlamaConfig(**{**fields, **(config_overrides or {})})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=bos, eos_token_id=eos if eos_token_id is None else eos_token_id)
    model.save_pretrained(path)
    if with_tokenizer:
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
            additional_special_tokens=list(SPECIAL_TOKENS[2:]))
        if chat_template:
            tokenizer.chat_template = CHAT_TEMPLATE
        tokenizer.save_pretrained(path)
    return path
