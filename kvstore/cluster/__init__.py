"""kvstore on Ray: actor names, bringing the cluster up and down, operator verbs, store nodes.

Import the modules themselves (``kvstore.cluster.lifecycle``, ``.operations``, ``.names``,
``.store_node``); this package file stays empty so that importing the names does not import Ray
actors, and the store node can import the names without a circle.
"""
