"""One store node's bytes, the server side: the arena and pool, the gRPC server, the write
path, the bulk byte channel, and what both ends of the wire share (the bulk frames, the Put
messages, the gRPC setup and status codes, the protobuf forms). The reader side is
``kvstore.client``.

Imports only the ground modules of ``kvstore`` (errors, config, constants, keys, block, api,
metrics, security, protos) and the index's plain data (``kvstore.index.base``); nothing here
knows about Ray, the coordinator or the index backends.
"""
