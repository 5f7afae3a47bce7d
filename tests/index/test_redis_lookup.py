"""The Redis index's lookup and batched publish, against the in-memory index as the reference.

The lookup is one ``HMGET`` of holder strings that the write scripts keep in step with the holder
sets, so these tests drive many random writes (holders up to dozens per key, gaps in chains,
removals) and compare every read with ``InMemoryIndex`` fed the same calls.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator

import pytest
import redis

from kvstore.index import redis as redis_backend
from kvstore.index.base import IndexEntry
from kvstore.index.memory import InMemoryIndex
from kvstore.index.redis import RedisIndex
from kvstore.index.redis_layout import decode_holders, decode_prefix
from tests.index.test_index import make_chain, make_entries
from tests.support.redis_server import RedisProcess

#: Node ids of different lengths, one not ASCII: the holder string is sorted bytewise in Lua
#: and must come back in the order Python's ``sorted`` gives.
NODES = [f"node-{i}" for i in range(40)] + ["n", "nœud-é", "node-10-b"]


@pytest.fixture
def redis_index(redis_server: RedisProcess) -> Iterator[RedisIndex]:
    index = RedisIndex(redis_server.url, key_prefix=f"lk-{uuid.uuid4().hex[:12]}:")
    yield index
    index.clear()
    index.close()


def make_random_entries(rng: random.Random, root: bytes, keys: list[bytes]) -> list[IndexEntry]:
    """Random spans of the chain, each announced by a random node (some keys get dozens)."""
    entries: list[IndexEntry] = []
    for _ in range(rng.randrange(1, 6)):
        lo = rng.randrange(len(keys))
        hi = rng.randrange(lo + 1, len(keys) + 1)
        node = rng.choice(NODES[:3]) if rng.random() < 0.5 else rng.choice(NODES)
        entries += make_entries(root, keys[:hi], node)[lo:]
    rng.shuffle(entries)
    return entries


@pytest.mark.redis
@pytest.mark.parametrize("seed", range(4))
def test_lookup_agrees_with_memory_index(redis_index: RedisIndex, seed: int,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    monkeypatch.setattr(redis_backend, "_CHUNK", rng.choice([5, 64, 2000]))
    chains = [make_chain(rng.randrange(1, 300), salt=f"s{i}", seed=seed) for i in range(3)]
    reference = InMemoryIndex()
    for _ in range(40):
        root, keys = rng.choice(chains)
        op = rng.random()
        if op < 0.6:
            entries = make_random_entries(rng, root, keys)
            reference.publish(entries)
            redis_index.publish(entries)
        elif op < 0.9:  # gaps: a random node gives up random keys
            gone = rng.sample(keys, rng.randrange(1, len(keys) + 1))
            node = rng.choice(NODES)
            reference.remove(gone, node)
            redis_index.remove(gone, node)
        else:
            node = rng.choice(NODES)
            assert redis_index.drop_node(node) == reference.drop_node(node)
        for _, ks in chains:
            start = rng.randrange(len(ks))  # a lookup may start anywhere in a chain
            assert redis_index.lookup_prefix(ks[start:]) == reference.lookup_prefix(ks[start:])
            assert redis_index.holders(ks) == reference.holders(ks)
    assert redis_index.num_keys() == reference.num_keys()
    assert redis_index.nodes() == reference.nodes()


@pytest.mark.redis
def test_lookup_of_a_key_with_every_node_and_unknown_keys(redis_index: RedisIndex) -> None:
    root, keys = make_chain(4)
    for node in reversed(NODES):
        redis_index.publish(make_entries(root, keys[:2], node))
    hit = redis_index.lookup_prefix(keys)
    assert hit.num_blocks == 2 and hit.holders == [sorted(NODES)] * 2
    hit.holders[0].append("caller-owned")  # each key has a list of its own
    assert hit.holders[1] == sorted(NODES)
    assert redis_index.lookup_prefix([b"\x07" * 32, *keys]).num_blocks == 0
    assert redis_index.holders([b"\x07" * 32, keys[0]]) == [[], sorted(NODES)]


@pytest.mark.redis
def test_batched_publish_is_one_round_trip_and_visible_on_return(
        redis_server: RedisProcess, redis_index: RedisIndex,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redis_backend, "_CHUNK", 7)  # 200 entries: 29 script calls
    root, keys = make_chain(200)
    sends: list[int] = []
    original = redis.connection.AbstractConnection.send_packed_command

    def counting(self: redis.connection.AbstractConnection, command: object,
                 check_health: bool = True) -> None:
        sends.append(1)
        original(self, command, check_health)  # type: ignore[arg-type]

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counting)
    redis_index.publish(make_entries(root, keys, "node-a"))
    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", original)
    assert len(sends) == 1
    # Another client, on its own connection, sees every key as soon as publish has returned.
    reader = RedisIndex(redis_server.url, key_prefix=redis_index._prefix.decode())
    assert reader.lookup_prefix(keys).holders == [["node-a"]] * 200
    assert reader.keys_of_node("node-a") == sorted(keys)
    assert reader.keys_of_namespace(root) == sorted(keys)
    reader.close()


@pytest.mark.redis
def test_batched_publish_survives_a_script_flush(redis_server: RedisProcess,
                                                 redis_index: RedisIndex,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redis_backend, "_CHUNK", 3)
    root, keys = make_chain(10)
    redis_server.client().script_flush()  # as after a Redis restart: NOSCRIPT on every call
    redis_index.publish(make_entries(root, keys, "node-a"))
    redis_server.client().script_flush()
    redis_index.remove(keys[5:], "node-a")
    assert redis_index.lookup_prefix(keys).holders == [["node-a"]] * 5


@pytest.mark.redis
def test_a_key_repeated_in_one_batch_ends_in_its_last_namespace(redis_index: RedisIndex) -> None:
    root_a, keys = make_chain(2, salt="a")
    root_b, _ = make_chain(1, salt="b")
    batch = [IndexEntry(keys[0], "node-a", 1, root_a, root_a),
             IndexEntry(keys[0], "node-b", 1, root_b, root_b),
             IndexEntry(keys[1], "node-a", 1, keys[0], root_a)]
    reference = InMemoryIndex()
    reference.publish(batch)
    redis_index.publish(batch)
    for root in (root_a, root_b):
        assert redis_index.keys_of_namespace(root) == reference.keys_of_namespace(root)
    assert redis_index.lookup_prefix(keys) == reference.lookup_prefix(keys)


def reference_prefix(joined: list[bytes | None]) -> list[list[str]]:
    out = []
    for s in joined:
        if s is None:
            break
        out.append(s.decode().split("\n"))
    return out


@pytest.mark.parametrize("seed", range(20))
def test_decode_prefix_against_a_plain_loop(seed: int) -> None:
    rng = random.Random(seed)
    strings = [b"a", b"a\nb", "b\nnœud".encode(), b"node-1\nnode-2\nnode-3"]
    joined = [rng.choice(strings) if rng.random() < 0.97 else None
              for _ in range(rng.randrange(0, 300))]
    got = decode_prefix(joined)
    assert got == reference_prefix(joined)
    assert len({id(h) for h in got}) == len(got)  # no two keys share a list
    assert decode_holders(joined) == [s.decode().split("\n") if s else [] for s in joined]
