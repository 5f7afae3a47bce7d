"""The model side of a worker: the causal LM adapter over ``transformers``, its attention
kernel choice, the device and numerics it runs with, its fingerprint, tokenizer and sampling."""
