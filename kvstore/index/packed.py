"""A batch of index entries that pickles as a few byte strings, for publishes over Ray.

A store node publishes each Put's entries to the coordinator with a Ray actor call, which
pickles its arguments, and a list of ``IndexEntry`` dataclasses pickled object by object costs
a large share of a Put. ``PackedEntries`` wraps the list on the sender; pickling it writes the
keys, parent keys and sizes as three byte strings (roots and node ids once each), and
unpickling gives the receiver a plain ``list[IndexEntry]``, so the coordinator's code is the
same whether or not the entries were packed.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

from kvstore.constants import KEY_NBYTES
from kvstore.index.base import IndexEntry


class PackedEntries(Sequence[IndexEntry]):
    """``entries`` as a sequence; pickles compactly and unpickles as ``list[IndexEntry]``."""

    __slots__ = ("entries",)

    def __init__(self, entries: Sequence[IndexEntry]) -> None:
        self.entries = list(entries)

    def __len__(self) -> int:
        return len(self.entries)

    @overload
    def __getitem__(self, i: int) -> IndexEntry: ...
    @overload
    def __getitem__(self, i: slice) -> list[IndexEntry]: ...
    def __getitem__(self, i: int | slice) -> IndexEntry | list[IndexEntry]:
        return self.entries[i]

    def __iter__(self) -> Iterator[IndexEntry]:
        return iter(self.entries)

    def __reduce__(self) -> tuple[Callable[..., list[IndexEntry]], tuple[Any, ...]]:
        es = self.entries
        if not all(isinstance(e, IndexEntry) and isinstance(e.key, bytes)
                   and isinstance(e.parent_key, bytes) and len(e.key) == KEY_NBYTES
                   and len(e.parent_key) == KEY_NBYTES and isinstance(e.nbytes, int)
                   and 0 <= e.nbytes < 1 << 63 for e in es):
            return list, (es,)  # not fixed-width: as it is, and the receiver's checks say why
        roots = list(dict.fromkeys(e.namespace_root for e in es))
        nodes = list(dict.fromkeys(e.node_id for e in es))
        root_at = {r: i for i, r in enumerate(roots)}
        node_at = {n: i for i, n in enumerate(nodes)}
        return unpack_entries, (
            b"".join(e.key for e in es), b"".join(e.parent_key for e in es),
            array("q", [e.nbytes for e in es]).tobytes(),
            roots, array("I", [root_at[e.namespace_root] for e in es]).tobytes(),
            nodes, array("I", [node_at[e.node_id] for e in es]).tobytes(),
        )


def unpack_entries(keys: bytes, parents: bytes, sizes: bytes, roots: list[bytes],
                   root_idx: bytes, nodes: list[str], node_idx: bytes) -> list[IndexEntry]:
    """The entries ``PackedEntries.__reduce__`` packed, as plain ``IndexEntry`` objects."""
    nbytes, ri, ni = array("q"), array("I"), array("I")
    nbytes.frombytes(sizes)
    ri.frombytes(root_idx)
    ni.frombytes(node_idx)
    k = KEY_NBYTES
    return [IndexEntry(keys[i * k : (i + 1) * k], nodes[ni[i]], nbytes[i],
                       parents[i * k : (i + 1) * k], roots[ri[i]]) for i in range(len(nbytes))]
