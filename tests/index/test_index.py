"""The global index on every backend, against a plain-dict model and each other.

Three backends: ``InMemoryIndex`` (dicts), ``TableIndex`` (the coordinator's compact table) and
``RedisIndex``; every contract test runs on each.
"""

from __future__ import annotations

import random
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import redis

from kvstore.config import IndexConfig
from kvstore.coordinator.table_index import TableIndex
from kvstore.errors import ConfigError, KVStoreError, NodeUnavailable, Unauthenticated
from kvstore.index import redis as redis_backend
from kvstore.index.base import Index, IndexEntry
from kvstore.index.factory import make_index
from kvstore.index.memory import InMemoryIndex
from kvstore.index.redis import RedisIndex, redact_url
from kvstore.keys import BlockHasher, Namespace
from tests.conftest import require_redis_server
from tests.support.redis_server import RedisProcess, free_port, start_redis_server


@pytest.fixture(params=["memory", "table", pytest.param("redis", marks=pytest.mark.redis)])
def index(request: pytest.FixtureRequest) -> Iterator[Index]:
    """A clean index on each backend (overrides conftest's two-backend fixture here)."""
    if request.param == "memory":
        idx: Index = InMemoryIndex()
    elif request.param == "table":
        idx = TableIndex()
    else:
        server = request.getfixturevalue("redis_server")
        idx = RedisIndex(server.url, key_prefix=f"test-{uuid.uuid4().hex[:12]}:")
    yield idx
    idx.clear()
    idx.close()


def make_namespace(salt: str = "") -> Namespace:
    return Namespace("fp-test", "float16", 4, 2, 2, 8, cache_salt=salt)


def make_chain(num_blocks: int, *, salt: str = "", seed: int = 0) -> tuple[bytes, list[bytes]]:
    """A namespace root and the chained keys of ``num_blocks`` random full blocks."""
    ns = make_namespace(salt)
    tokens = random.Random(seed).choices(range(1000), k=num_blocks * ns.block_size)
    return ns.root, list(BlockHasher(ns).block_keys(tokens))


def make_entries(root: bytes, keys: list[bytes], node_id: str, nbytes: int = 1024
                 ) -> list[IndexEntry]:
    parents = [root, *keys[:-1]]
    return [IndexEntry(k, node_id, nbytes, p, root) for k, p in zip(keys, parents, strict=True)]


def test_lookup_prefix_stops_at_first_missing_key(index: Index) -> None:
    root, keys = make_chain(6)
    index.publish(make_entries(root, [keys[i] for i in (0, 1, 2, 4, 5)], "node-a"))
    hit = index.lookup_prefix(keys)
    assert hit.num_blocks == 3  # keys[3] is missing: 4 and 5 are useless without it
    assert hit.holders == [["node-a"]] * 3
    assert index.lookup_prefix(keys[1:]).num_blocks == 2
    assert index.lookup_prefix(keys[3:]).num_blocks == 0
    assert index.lookup_prefix([]).num_blocks == 0
    assert index.holders(keys) == [["node-a"]] * 3 + [[]] + [["node-a"]] * 2


def test_several_holders(index: Index) -> None:
    root, keys = make_chain(3)
    index.publish(make_entries(root, keys, "node-b"))
    index.publish(make_entries(root, keys[:2], "node-a"))
    index.publish(make_entries(root, keys[:1], "node-a"))  # publishing twice changes nothing
    hit = index.lookup_prefix(keys)
    assert hit.num_blocks == 3
    assert hit.holders == [["node-a", "node-b"], ["node-a", "node-b"], ["node-b"]]
    assert index.nodes() == ["node-a", "node-b"]
    assert index.num_keys() == 3
    assert index.keys_of_node("node-a") == sorted(keys[:2])


def test_info_holds_what_was_published(index: Index) -> None:
    root, keys = make_chain(2)
    index.publish(make_entries(root, keys, "node-a", nbytes=4096))
    first, second, unknown = index.info([keys[0], keys[1], b"\x01" * 32])
    assert unknown is None
    assert first is not None and second is not None
    assert (first.key, first.holders, first.nbytes) == (keys[0], ["node-a"], 4096)
    assert (first.parent_key, first.namespace_root) == (root, root)
    assert second.parent_key == keys[0]
    assert first.last_use > 0


def test_remove_last_holder_removes_the_key(index: Index) -> None:
    root, keys = make_chain(3)
    index.publish(make_entries(root, keys, "node-a"))
    index.publish(make_entries(root, keys[:1], "node-b"))
    index.remove([keys[0], keys[1]], "node-a")
    assert index.holders(keys) == [["node-b"], [], ["node-a"]]
    assert index.info([keys[1]]) == [None]
    assert index.num_keys() == 2
    assert index.keys_of_namespace(root) == sorted([keys[0], keys[2]])
    assert index.lookup_prefix(keys).num_blocks == 1
    index.remove([keys[2]], "node-a")
    assert index.nodes() == ["node-b"]  # node-a holds nothing any more
    index.remove([keys[0], b"\x02" * 32], "node-zzz")  # not a holder / unknown key: no-op
    assert index.holders([keys[0]]) == [["node-b"]]


def test_drop_node(index: Index, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redis_backend, "_CHUNK", 3)  # make Redis drop in several batches
    root, keys = make_chain(8)
    index.publish(make_entries(root, keys, "node-a"))
    index.publish(make_entries(root, keys[:2], "node-b"))
    assert index.drop_node("node-a") == 8
    assert index.keys_of_node("node-a") == []
    assert index.nodes() == ["node-b"]
    assert index.num_keys() == 2
    assert index.keys_of_namespace(root) == sorted(keys[:2])
    assert index.lookup_prefix(keys).holders == [["node-b"], ["node-b"]]
    assert index.drop_node("node-a") == 0


def test_touch_records_last_use_and_never_goes_back(index: Index) -> None:
    root, keys = make_chain(2)
    index.publish(make_entries(root, keys, "node-a"))
    index.touch([keys[0]], now=4_000_000_000.5)
    index.touch([keys[0]], now=3_000_000_000.0)  # a lagging clock must not make it look cold
    first, second = index.info(keys)
    assert first is not None and second is not None
    assert first.last_use == 4_000_000_000.5
    assert second.last_use < first.last_use
    index.touch([b"\x03" * 32], now=5e9)  # unknown keys are not created by a touch
    assert index.num_keys() == 2 and index.info([b"\x03" * 32]) == [None]


def test_keys_of_namespace_separates_tenants(index: Index) -> None:
    root_a, keys_a = make_chain(3, salt="tenant-a")
    root_b, keys_b = make_chain(2, salt="tenant-b")
    assert root_a != root_b and not set(keys_a) & set(keys_b)  # same tokens, other salt
    index.publish(make_entries(root_a, keys_a, "node-a") + make_entries(root_b, keys_b, "node-a"))
    assert index.keys_of_namespace(root_a) == sorted(keys_a)
    assert index.keys_of_namespace(root_b) == sorted(keys_b)
    assert index.keys_of_namespace(b"\x04" * 32) == []


def test_clear(index: Index) -> None:
    root, keys = make_chain(3)
    index.publish(make_entries(root, keys, "node-a"))
    index.clear()
    assert index.num_keys() == 0 and index.nodes() == [] and index.keys_of_node("node-a") == []
    assert index.lookup_prefix(keys).num_blocks == 0


def test_bad_input_is_rejected_and_writes_nothing(index: Index) -> None:
    root, keys = make_chain(2)
    good = make_entries(root, keys, "node-a")
    with pytest.raises(TypeError, match="non-empty bytes"):
        index.publish([good[0], IndexEntry("not-bytes", "node-a", 1, root, root)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nbytes"):
        index.publish([good[0], IndexEntry(keys[1], "node-a", -1, root, root)])
    with pytest.raises(ValueError, match="node_id"):
        index.publish([IndexEntry(keys[1], "", 1, root, root)])
    with pytest.raises(TypeError, match="sequence of keys"):
        index.lookup_prefix(keys[0])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="non-empty bytes"):
        index.holders([keys[0].hex()])  # type: ignore[list-item]
    assert index.num_keys() == 0  # the valid first entries of a bad batch were not written


@dataclass
class DictModel:
    """The reference: the contract written as directly as possible."""

    holders: dict[bytes, set[str]] = field(default_factory=dict)
    namespace: dict[bytes, bytes] = field(default_factory=dict)

    def publish(self, entries: list[IndexEntry]) -> None:
        for e in entries:
            self.holders.setdefault(e.key, set()).add(e.node_id)
            self.namespace[e.key] = e.namespace_root

    def remove(self, keys: list[bytes], node_id: str) -> None:
        for k in keys:
            self.holders.get(k, set()).discard(node_id)
            if k in self.holders and not self.holders[k]:
                del self.holders[k]

    def drop_node(self, node_id: str) -> int:
        held = [k for k, h in self.holders.items() if node_id in h]
        self.remove(held, node_id)
        return len(held)

    def lookup(self, keys: list[bytes]) -> list[list[str]]:
        out = []
        for k in keys:
            if k not in self.holders:
                break
            out.append(sorted(self.holders[k]))
        return out


@pytest.mark.redis
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_ops_agree_with_model(redis_server: RedisProcess, seed: int) -> None:
    rng = random.Random(seed)
    chains = [make_chain(6, salt=s, seed=seed) for s in ("x", "y")]
    nodes = ["n0", "n1", "n2"]
    model = DictModel()
    backends: list[Index] = [InMemoryIndex(), TableIndex(),
                             RedisIndex(redis_server.url, key_prefix=f"rnd-{uuid.uuid4().hex}:")]
    try:
        for _ in range(150):
            root, keys = rng.choice(chains)
            lo = rng.randrange(len(keys))
            span = keys[lo:rng.randrange(lo + 1, len(keys) + 1)]
            node = rng.choice(nodes)
            op = rng.choices(["publish", "remove", "drop"], weights=[5, 3, 1])[0]
            if op == "publish":
                parents = [root, *keys][lo:lo + len(span)]
                entries = [IndexEntry(k, node, 64, p, root) for k, p in zip(span, parents,
                                                                            strict=True)]
                model.publish(entries)
                for b in backends:
                    b.publish(entries)
            elif op == "remove":
                model.remove(span, node)
                for b in backends:
                    b.remove(span, node)
            else:
                expected = model.drop_node(node)
                assert [b.drop_node(node) for b in backends] == [expected] * len(backends)
            for b in backends:
                for _, ks in chains:
                    hit = b.lookup_prefix(ks)
                    assert hit.holders == model.lookup(ks) and hit.num_blocks == len(hit.holders)
                    assert b.holders(ks) == [sorted(model.holders.get(k, ())) for k in ks]
                assert b.num_keys() == len(model.holders)
                assert b.nodes() == sorted({n for h in model.holders.values() for n in h})
                for n in nodes:
                    assert b.keys_of_node(n) == sorted(k for k, h in model.holders.items()
                                                       if n in h)
                for r, _ in chains:
                    assert b.keys_of_namespace(r) == sorted(
                        k for k in model.holders if model.namespace[k] == r)
    finally:
        for b in backends:
            b.clear()
            b.close()


@pytest.mark.parametrize("make", [InMemoryIndex, TableIndex])
def test_embedded_indexes_are_thread_safe(make: type) -> None:
    index = make()
    root, keys = make_chain(64)

    def work(node: str) -> None:
        for i in range(0, len(keys), 4):
            index.publish(make_entries(root, keys[i:i + 4], node))
            index.touch(keys[i:i + 4])
            index.lookup_prefix(keys)

    threads = [threading.Thread(target=work, args=(f"n{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert index.lookup_prefix(keys).holders == [["n0", "n1", "n2", "n3"]] * 64


# --- TableIndex-only behaviour ------------------------------------------------------------------


def test_table_index_recycles_bits_of_empty_unclaimed_nodes() -> None:
    index = TableIndex(max_nodes=64)  # the holder sets take any number; a cap still recycles
    root, keys = make_chain(2)
    claimed = index.claim_node("coordinator-slot")  # claimed: kept even while it holds nothing
    for i in range(63):
        index.publish(make_entries(root, keys[:1], f"n{i:02d}"))
        index.remove(keys[:1], f"n{i:02d}")  # holds nothing now, but keeps its bit until needed
    index.publish(make_entries(root, keys, "late"))  # 65th node: an empty bit is recycled
    assert index.holders(keys) == [["late"], ["late"]]
    assert index.claim_node("coordinator-slot") == claimed
    for i in range(62):
        index.publish(make_entries(root, keys[:1], f"busy{i}"))  # every bit now in use
    with pytest.raises(KVStoreError, match="at most 64"):
        index.publish(make_entries(root, keys, "one-too-many"))
    assert "one-too-many" not in index.nodes()


def test_table_index_rejects_keys_that_are_not_32_bytes() -> None:
    index = TableIndex()
    root, keys = make_chain(1)
    with pytest.raises(KVStoreError, match="32 bytes"):
        index.lookup_prefix([b"short"])
    with pytest.raises(KVStoreError, match="32 bytes"):
        index.publish([IndexEntry(keys[0], "node-a", 1, b"short-parent", root)])
    assert index.num_keys() == 0


# --- Redis-only behaviour -----------------------------------------------------------------------


@pytest.mark.redis
def test_lookup_prefix_is_one_round_trip(redis_server: RedisProcess,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    index = RedisIndex(redis_server.url, key_prefix=f"rt-{uuid.uuid4().hex}:")
    root, keys = make_chain(40)
    index.publish(make_entries(root, keys[:30], "node-a"))
    sent: list[bytes] = []
    original = redis.connection.AbstractConnection.send_packed_command

    def counting(self: redis.connection.AbstractConnection, command: object,
                 check_health: bool = True) -> None:
        sent.append(command if isinstance(command, bytes) else b"".join(command))  # type: ignore[arg-type]
        original(self, command, check_health)  # type: ignore[arg-type]

    stats_before = redis_server.client().info("commandstats")
    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counting)
    hit = index.lookup_prefix(keys)
    monkeypatch.undo()
    stats_after = redis_server.client().info("commandstats")
    assert hit.num_blocks == 30
    assert len(sent) == 1 and b"HMGET" in sent[0].upper()
    assert (stats_after["cmdstat_hmget"]["calls"]
            - stats_before.get("cmdstat_hmget", {"calls": 0})["calls"]) == 1
    index.clear()
    index.close()


@pytest.mark.redis
def test_key_prefixes_isolate_indexes(redis_server: RedisProcess) -> None:
    tag = uuid.uuid4().hex
    star, plain = (RedisIndex(redis_server.url, key_prefix=f"{tag}*:"),
                   RedisIndex(redis_server.url, key_prefix=f"{tag}a:"))
    root, keys = make_chain(2)
    star.publish(make_entries(root, keys, "node-a"))
    plain.publish(make_entries(root, keys[:1], "node-b"))
    assert plain.holders(keys) == [["node-b"], []]
    star.clear()  # the glob character in the prefix must not match the other index's keys
    assert plain.num_keys() == 1 and star.num_keys() == 0
    plain.clear()


@pytest.fixture
def private_redis(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """A function-scoped server with the settings in the test's parameter (password, TLS)."""
    require_redis_server()
    opts = dict(getattr(request, "param", {}))
    if opts.pop("tls", False):
        opts["tls_dir"] = tmp_path_factory.mktemp("tls")
    server = start_redis_server(**opts)
    yield server
    server.stop()


@pytest.mark.redis
@pytest.mark.parametrize("private_redis", [{"password": "s3cret-pw"}], indirect=True)
def test_redis_password(private_redis: RedisProcess) -> None:
    url = private_redis.url
    assert ":s3cret-pw@" in url
    index = RedisIndex(url, key_prefix="pw:")
    root, keys = make_chain(1)
    index.publish(make_entries(root, keys, "node-a"))
    assert index.num_keys() == 1
    index.close()
    for bad in (url.replace("s3cret-pw", "wrong-pw"), url.replace(":s3cret-pw@", "")):
        with pytest.raises(Unauthenticated) as err:
            RedisIndex(bad)
        assert "s3cret-pw" not in str(err.value) and "wrong-pw" not in str(err.value)
        assert str(private_redis.port) in str(err.value)


@pytest.mark.redis
@pytest.mark.parametrize("private_redis", [{"tls": True, "password": "tls-pw"}], indirect=True)
def test_redis_over_tls(private_redis: RedisProcess) -> None:
    assert private_redis.url.startswith("rediss://") and private_redis.ca_file
    index = make_index(IndexConfig(backend="redis", redis_url=private_redis.url,
                                   redis_ca_file=private_redis.ca_file))
    root, keys = make_chain(3)
    index.publish(make_entries(root, keys, "node-a"))
    assert index.lookup_prefix(keys).num_blocks == 3
    index.close()
    with pytest.raises(NodeUnavailable, match="certificate"):  # the private CA is not trusted
        RedisIndex(private_redis.url)
    with pytest.raises(NodeUnavailable):  # plain text to a TLS-only port
        RedisIndex(private_redis.url.replace("rediss://", "redis://"), timeout_s=2)


@pytest.mark.redis
def test_redis_restart_reconnects(private_redis: RedisProcess) -> None:
    index = RedisIndex(private_redis.url)
    root, keys = make_chain(3)
    index.publish(make_entries(root, keys, "node-a"))
    old_pid = private_redis.pid
    private_redis.restart()
    assert private_redis.pid != old_pid
    # Redis keeps nothing on disk: the index is empty, and store nodes re-announce.
    assert index.lookup_prefix(keys).num_blocks == 0
    index.publish(make_entries(root, keys, "node-a"))  # scripts are reloaded transparently
    assert index.lookup_prefix(keys).holders == [["node-a"]] * 3
    index.close()


@pytest.mark.redis
def test_redis_down_is_node_unavailable(private_redis: RedisProcess) -> None:
    index = RedisIndex(private_redis.url)
    private_redis.stop()
    with pytest.raises(NodeUnavailable, match=f"127.0.0.1:{private_redis.port}"):
        index.lookup_prefix([b"\x05" * 32])
    url = f"redis://:hidden-pw@127.0.0.1:{free_port()}/0"
    with pytest.raises(NodeUnavailable) as err:
        RedisIndex(url, timeout_s=1)
    assert "hidden-pw" not in str(err.value) and ":***@" in str(err.value)


def test_make_index_and_url_redaction() -> None:
    assert isinstance(make_index(IndexConfig()), InMemoryIndex)
    with pytest.raises(ConfigError, match="rediss://"):
        RedisIndex("redis://127.0.0.1:1/0", ssl_ca_certs="/tmp/ca.crt")
    assert redact_url("redis://:pw@h:1/0") == "redis://:***@h:1/0"
    assert redact_url("rediss://user:pw@h:1/0") == "rediss://user:***@h:1/0"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"
