"""Argument checks every index backend runs before it touches anything.

A malformed batch is refused whole, before the first write, so a bad caller never leaves an
index half-updated; and a ``str`` where bytes belong raises instead of silently never matching.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

from kvstore.index.base import IndexEntry

_FIELDS = attrgetter("key", "parent_key", "namespace_root", "node_id", "nbytes")
_NODE = attrgetter("node_id")


Columns = tuple[tuple[bytes, ...], tuple[bytes, ...], tuple[bytes, ...], tuple[str, ...],
                tuple[int, ...]]


def entry_columns(entries: Sequence[IndexEntry], key_nbytes: int = 0) -> Columns | None:
    """``(keys, parents, roots, node_ids, sizes)`` of well-formed entries, checked in C loops
    (keys, parents and roots exactly ``key_nbytes`` long where given); ``None`` when something
    is not exactly as expected (then ``check_entries`` says what)."""
    if not entries or not set(map(type, entries)) <= {IndexEntry}:
        return None
    keys, parents, roots, nodes, sizes = zip(*map(_FIELDS, entries), strict=True)
    if not (set(map(type, keys + parents + roots)) <= {bytes} and set(map(type, nodes)) <= {str}
            and set(map(type, sizes)) <= {int} and min(sizes) >= 0 and all(nodes)):
        return None
    if roots.count(roots[0]) == len(roots):  # one namespace (the usual batch): one root to size
        roots_ = roots[:1]
    else:
        roots_ = roots
    if key_nbytes:
        ok = set(map(len, keys + parents + roots_)) == {key_nbytes}
    else:
        ok = all(keys) and all(parents) and all(roots_)
    return (keys, parents, roots, nodes, sizes) if ok else None


def check_entries(entries: Sequence[IndexEntry]) -> None:
    """Reject malformed entries before anything is written, so a bad batch changes nothing."""
    # Fast path in C loops (the per-entry loop below is a visible share of a Redis publish):
    # only exact types pass here; anything else gets the exact check and its message.
    if not entries or entry_columns(entries) is not None:
        return
    for e in entries:
        if not isinstance(e, IndexEntry):
            raise TypeError(f"publish takes IndexEntry objects, got {type(e).__name__}")
        check_keys([e.key, e.parent_key, e.namespace_root])
        check_node_id(e.node_id)
        if not isinstance(e.nbytes, int) or e.nbytes < 0:
            raise ValueError(f"IndexEntry.nbytes must be an int >= 0, got {e.nbytes!r}")


def check_keys(keys: Sequence[bytes]) -> None:
    """Keys are non-empty bytes; a str here is a caller bug that would silently never match."""
    if isinstance(keys, (bytes, str)):
        raise TypeError("pass a sequence of keys, not a single key")
    # Fast path in C loops (a 2,048-key lookup would otherwise spend a tenth of its time here):
    # every key exactly bytes, none empty. Anything else falls through to the exact check.
    if set(map(type, keys)) <= {bytes} and all(keys):
        return
    for k in keys:
        if not isinstance(k, bytes) or not k:
            raise TypeError(f"index keys must be non-empty bytes, got {k!r:.80}")


def check_node_id(node_id: str) -> None:
    """Node ids are non-empty str."""
    if not isinstance(node_id, str) or not node_id:
        raise ValueError(f"node_id must be a non-empty str, got {node_id!r}")


def owned_by(node_id: str, entries: Sequence[IndexEntry]) -> bool:
    """Whether every entry is exactly an ``IndexEntry`` naming ``node_id``, checked in C loops
    (``False``: look entry by entry to say which one is wrong)."""
    if not set(map(type, entries)) <= {IndexEntry}:
        return False
    nodes = list(map(_NODE, entries))
    return set(map(type, nodes)) <= {str} and nodes.count(node_id) == len(nodes)
