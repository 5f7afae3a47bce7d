"""Connectors that plug the store into inference engines users already run (one subpackage
per engine, e.g. ``kvstore.integrations.vllm``). They use the client layer (``ClusterStore``,
``LocalStore``) and the cluster's ``connect``; nothing below imports them."""
