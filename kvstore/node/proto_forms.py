"""Plain values in their protobuf form and back: a namespace (``NamespaceSpec``) and a reader's
metrics tally (``ReaderReport``).

A namespace travels without its secrets (``data_key``, ``tenant_key``): the receiving node
supplies its own copy of the cluster's data key. A tally travels whole; its labels are checked
where it is applied, not here.
"""

from __future__ import annotations

from kvstore.keys import Namespace
from kvstore.protos import kvstore_pb2 as pb
from kvstore.reader_metrics import ReaderTally


def namespace_from_spec(spec: pb.NamespaceSpec, data_key: bytes | None = None) -> Namespace:
    """Rebuild the writer's namespace (raises ConfigError on nonsense fields); ``data_key`` is
    the node's copy of the cluster's data secret (the wire never carries it)."""
    return Namespace(data_key=data_key,
        model_fingerprint=spec.model_fingerprint, dtype=spec.dtype, block_size=spec.block_size,
        num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        cache_salt=spec.cache_salt, schema_version=spec.schema_version,
        numerics=spec.numerics,
    )


def spec_from_namespace(ns: Namespace) -> pb.NamespaceSpec:
    """The wire form of a namespace."""
    return pb.NamespaceSpec(
        schema_version=ns.schema_version, model_fingerprint=ns.model_fingerprint,
        dtype=ns.dtype, block_size=ns.block_size, num_layers=ns.num_layers,
        num_kv_heads=ns.num_kv_heads, head_dim=ns.head_dim, cache_salt=ns.cache_salt,
        numerics=ns.numerics,
    )


def tally_to_proto(tally: ReaderTally) -> pb.ReaderReport:
    """A reader's metrics tally as the ``ReportReads`` message."""
    return pb.ReaderReport(
        hits=tally.hits, misses=dict(tally.misses), rejected=dict(tally.rejected),
        fetched_blocks=dict(tally.fetched_blocks), fetched_bytes=dict(tally.fetched_bytes),
        fetch_seconds=[pb.FetchTimes(path=p, seconds=s) for p, s in tally.fetch_seconds.items()],
        prefill_tokens=dict(tally.prefill_tokens),
    )


def tally_from_proto(msg: pb.ReaderReport) -> ReaderTally:
    """The tally a ``ReportReads`` message carries (labels are checked when it is applied)."""
    tally = ReaderTally(hits=msg.hits)
    tally.misses.update(dict(msg.misses))
    tally.rejected.update(dict(msg.rejected))
    tally.fetched_blocks.update(dict(msg.fetched_blocks))
    tally.fetched_bytes.update(dict(msg.fetched_bytes))
    tally.prefill_tokens.update(dict(msg.prefill_tokens))
    for times in msg.fetch_seconds:
        tally.fetch_seconds.setdefault(times.path, []).extend(times.seconds)
    return tally
