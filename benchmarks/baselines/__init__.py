"""Other projects' KV connectors, run as bench_vllm's baselines, each from a venv of its own.

``setup.sh`` installs them; ``instance.run_xinstance`` measures one; ``measure`` runs them all
against a no-connector instance; ``lmcache_cpu`` is what LMCache lacks on vLLM's CPU backend.
"""
