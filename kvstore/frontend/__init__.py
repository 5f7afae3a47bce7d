"""The OpenAI-compatible HTTP front end (``kvstore serve``) on Ray Serve (docs/design.md §4,
serving over HTTP)."""
