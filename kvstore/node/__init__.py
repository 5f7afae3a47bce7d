"""One store node's bytes, both ends: the arena and pool, the gRPC server, the bulk byte
channel, same-node shared-memory reads, the client, and what the two ends of the wire share.

Imports only the ground modules of ``kvstore`` (errors, config, constants, keys, block, api,
metrics); nothing here knows about Ray, the coordinator or the index backends.
"""
