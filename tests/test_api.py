"""The plain data of ``kvstore.api``: what its methods promise."""

from __future__ import annotations

from kvstore.api import PrefixHit


def test_blocks_per_node_counts_only_the_cached_prefix() -> None:
    hit = PrefixHit(3, [["n1", "n2"], ["n1"], ["n1", "n3"], ["n2"]])
    assert hit.blocks_per_node() == {"n1": 3, "n2": 1, "n3": 1}


def test_blocks_per_node_counts_a_node_once_per_block() -> None:
    assert PrefixHit(2, [["n1", "n1"], ["n1"]]).blocks_per_node() == {"n1": 2}


def test_a_miss_is_held_by_no_node() -> None:
    assert PrefixHit(0, [["n1"]]).blocks_per_node() == {}
    assert PrefixHit(0, []).blocks_per_node() == {}
