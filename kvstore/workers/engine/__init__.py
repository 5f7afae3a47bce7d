"""The engine: one request through the model with exact block-granular reuse (admission, the
reuse policy, fetching and publishing blocks, the prefill chunks and the decode tokens)."""
