"""Replicas of the engine (in-process or Ray actors), where they are placed, and the request
pipeline that carries a request through a prefill replica and a decode replica."""
