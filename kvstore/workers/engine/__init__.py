"""The engine: one request through the model with exact block-granular reuse.

``prefill_decode.Engine`` is the entry point; it composes admission (``admission``), the reuse
policy (``reuse_policy``) and its per-request decisions (``prefix_reuse``), fetching and
publishing blocks (``block_io``, ``background_publisher``, ``paged_kv``), the prefill chunks
(``prefill_chunks``) and the decode tokens (``decode_tokens``), and returns ``results``.
"""
