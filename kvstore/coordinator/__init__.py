"""The coordinator: one LRU view of the whole cluster, eviction, pins, liveness, recovery.

``core`` holds every policy in plain Python (tested without Ray); ``actor`` is the thin Ray
shell around it; ``lru`` and ``table_index`` are its compact table, which is also the embedded
index; ``index_proxy`` lets readers use the ``Index`` protocol through the actor. Names and
placement on Ray belong to ``kvstore.cluster``, not here.
"""
