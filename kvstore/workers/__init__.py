"""The workers: a real torch model (``model``), the engine that runs a request through it with
exact reuse of cached blocks (``engine``), its replicas and their request pipeline
(``replicas``), and the prefill/decode jobs (``jobs``)."""
