"""The reader side of the store: the store-node client (gRPC, bulk TCP, shared-memory and
device reads, the verify pool) and the two ``KVStore`` implementations built on it,
``LocalStore`` (embedded) and ``ClusterStore`` (a cluster's index plus its nodes)."""
