"""Who may do what on a store node, and the secrets behind it (docs/security.md).

Ground-level: the node, the index service, the stores, the cluster and the CLI all use it, and
it imports nothing of theirs.
"""
