"""``kvstore ls`` in the coordinator: cached prefixes and namespaces, against a brute-force model.

Both index modes: the embedded table and an external index (``InMemoryIndex`` standing in for
Redis) that the LRU table mirrors.
"""

from __future__ import annotations

import pytest

from kvstore.api import NodeAddress
from kvstore.config import KVStoreConfig
from kvstore.coordinator.catalog import NamespaceTable
from kvstore.coordinator.core import CoordinatorCore
from kvstore.index.base import Index
from kvstore.index.memory import InMemoryIndex
from tests.coordinator.test_core import (
    BLOCK,
    ROOT,
    ROOT_B,
    FakeClock,
    make_chain,
    make_entries,
)

BLOCK_SIZE = 16


def make_desc(root: bytes, **fields: object) -> dict[str, object]:
    desc: dict[str, object] = {"root": root.hex(), "model": "tiny", "model_fingerprint": "f" * 64,
                               "dtype": "float32", "block_size": BLOCK_SIZE, "num_layers": 2,
                               "num_kv_heads": 2, "head_dim": 16, "salt": "default"}
    desc.update(fields)
    return desc


@pytest.fixture(params=["table", "dict"])
def core(request: pytest.FixtureRequest) -> CoordinatorCore:
    index: Index | None = InMemoryIndex() if request.param == "dict" else None
    return CoordinatorCore(KVStoreConfig(), index=index, clock=FakeClock())


def publish(core: CoordinatorCore, node_id: str, chain: list[bytes], root: bytes = ROOT,
            parent: bytes | None = None) -> None:
    """Publish ``chain`` on ``node_id``; ``parent``: the block before it (default the root)."""
    if core.nodes.get(node_id) is None:
        core.register_node(node_id, NodeAddress(node_id, f"{node_id}:1"), 10_000, [])
    entries = make_entries(node_id, chain, root)
    if parent is not None:
        entries[0].parent_key = parent
    core.publish(node_id, entries)


def expected_leaves(chains: list[list[bytes]]) -> dict[bytes, int]:
    """The reference: every chain's last key that is no other chain's inner key, with its
    depth (the chains start at a namespace root, so depth is the chain's length)."""
    inner = {k for c in chains for k in c[:-1]}
    return {c[-1]: len(c) for c in chains if c[-1] not in inner}


def test_ls_lists_chain_ends_with_depth_holders_pins_and_namespaces(core: CoordinatorCore
                                                                     ) -> None:
    a = make_chain(5, "a")
    b = a[:3] + make_chain(2, "b", root=a[2])  # shares a's first 3 blocks
    c = make_chain(2, "c", root=ROOT_B)
    publish(core, "n1", a)
    publish(core, "n2", b[3:], parent=a[2])  # the branch lives on another node
    publish(core, "n1", c, ROOT_B)
    core.namespaces.describe(make_desc(ROOT))
    core.touch([c[-1]])  # the most recent chain end
    core.pin(a, hard=True, ttl_s=None)

    view = core.listing(limit=10)

    want = expected_leaves([a, b, c])
    got = {bytes.fromhex(p["key"]): p for p in view["prefixes"]}
    assert {k: p["blocks"] for k, p in got.items()} == want
    assert view["num_prefixes"] == 3
    assert view["prefixes"][0]["key"] == c[-1].hex()
    assert got[a[-1]]["tokens"] == 5 * BLOCK_SIZE and got[a[-1]]["complete"]
    assert got[c[-1]]["tokens"] is None  # nobody described ROOT_B: no block size known
    assert got[a[-1]]["holders"] == ["n1"] and got[b[-1]]["holders"] == ["n2"]
    assert got[a[-1]]["pinned_blocks"] == 5 and got[b[-1]]["pinned_blocks"] == 3
    assert got[b[-1]]["bytes"] == 5 * BLOCK
    spaces = {ns["root"]: ns for ns in view["namespaces"]}
    assert spaces[ROOT.hex()]["blocks"] == 7 and spaces[ROOT.hex()]["bytes"] == 7 * BLOCK
    assert spaces[ROOT.hex()]["described"] and spaces[ROOT.hex()]["model"] == "tiny"
    assert spaces[ROOT_B.hex()] == {"root": ROOT_B.hex(), "described": False, "blocks": 2,
                                    "bytes": 2 * BLOCK}


def test_ls_limit_keeps_the_most_recent(core: CoordinatorCore) -> None:
    chains = [make_chain(2, f"s{i}") for i in range(6)]
    for chain in chains:
        publish(core, "n1", chain)
    core.touch([chains[4][-1], chains[1][-1]])  # chains[1] last: the most recent
    view = core.listing(limit=2)
    assert [p["key"] for p in view["prefixes"]] == [chains[1][-1].hex(), chains[4][-1].hex()]
    assert view["num_prefixes"] == 6


def test_ls_marks_a_chain_whose_start_was_evicted_partial(core: CoordinatorCore) -> None:
    chain = make_chain(4, "p")
    publish(core, "n1", chain)
    core.removed("n1", [chain[0]])
    (prefix,) = core.listing()["prefixes"]
    assert prefix["key"] == chain[-1].hex()
    assert prefix["blocks"] == 3 and not prefix["complete"]


def test_pin_counts_cached_and_pins_ahead_only_when_asked(core: CoordinatorCore) -> None:
    chain = make_chain(2, "k")
    unknown = make_chain(1, "never-published")[0]
    publish(core, "n1", chain)
    assert core.pin([chain[0], unknown], hard=True, ttl_s=None, ahead=False) == (1, 1)
    assert chain[0] in core.pins and unknown not in core.pins
    assert core.pin([unknown], hard=True, ttl_s=None, ahead=False) == (0, 0)
    assert core.pin([unknown], hard=True, ttl_s=None, ahead=True) == (1, 0)
    assert unknown in core.pins
    assert core.num_cached([*chain, unknown]) == 2


def test_namespace_descriptor_must_be_whole() -> None:
    table = NamespaceTable()
    with pytest.raises(ValueError, match="lacks"):
        table.describe({"root": ROOT.hex()})
    with pytest.raises(ValueError, match="64 lower-case hex"):
        table.describe({**make_desc(ROOT), "root": "xyz"})
    table.describe(make_desc(ROOT))
    assert table.get(ROOT.hex())["model"] == "tiny"  # type: ignore[index]


def test_invalidate_keys_evicts_exactly_the_cached_ones_everywhere(core: CoordinatorCore
                                                                   ) -> None:
    chain = make_chain(3, "i")
    other = make_chain(2, "o")
    publish(core, "n1", chain)
    publish(core, "n2", chain[:2])  # a replica of the first two
    publish(core, "n1", other)
    core.pin(chain, hard=True, ttl_s=None)
    unknown = make_chain(1, "never-published")[0]
    assert core.invalidate_keys([chain[0], chain[1], unknown]) == 2
    assert core.holders(chain) == [[], [], ["n1"]]
    assert core.holders(other) == [["n1"], ["n1"]]
    assert chain[0] not in core.pins and chain[2] in core.pins
    for node_id in ("n1", "n2"):
        assert set(core.nodes.get(node_id).pending_evict) == {chain[0], chain[1]}
