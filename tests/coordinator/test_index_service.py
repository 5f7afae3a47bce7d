"""The coordinator's gRPC index service against the core it fronts (the reference), its
refusals, its codecs, the fallback to the actor, and a restarted coordinator on a new port."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import grpc
import pytest

from kvstore.api import NodeAddress
from kvstore.config import ClientConfig, CoordinatorConfig, KVStoreConfig, ServerConfig
from kvstore.coordinator.core import CoordinatorCore
from kvstore.coordinator.index_service import (
    NO_ANSWER,
    FastPath,
    IndexClient,
    IndexServer,
    decode_holders,
    decode_publish,
    encode_holders,
    encode_publish,
)
from kvstore.errors import InvalidRequest, NodeUnavailable, Unauthenticated
from kvstore.protos import kvstore_pb2 as pb
from kvstore.protos import kvstore_pb2_grpc as pb_grpc
from tests.coordinator.test_core import FakeClock, make_chain, make_entries

FAST = ClientConfig(timeout_s=5, retries=0)


@pytest.fixture
def served() -> Iterator[tuple[CoordinatorCore, IndexServer]]:
    core = CoordinatorCore(KVStoreConfig(), clock=FakeClock())
    server = IndexServer(core, ServerConfig(), 0)
    server.start()
    yield core, server
    server.stop()


def test_lookups_and_publishes_answer_as_the_core_does(served) -> None:
    core, server = served
    client = IndexClient(server.address, FAST)
    a, b = make_chain(6, uuid.uuid4().hex), make_chain(3, uuid.uuid4().hex)
    client.publish("node-a", make_entries("node-a", a))
    core.publish("node-b", make_entries("node-b", a[:2] + b))  # the reference's own door
    for keys in (a, a[:1], b, a[:3] + b, [b[2]], [*a, make_chain(1, "absent")[0]], []):
        hit, want = client.lookup_prefix(keys), core.lookup_prefix(keys)
        assert (hit.num_blocks, hit.holders) == (want.num_blocks, want.holders)
        assert client.holders(keys) == core.holders(keys)
    assert client.lookup_prefix(a).holders[0] == ["node-a", "node-b"]
    assert client.lookup_prefix(a).num_blocks == 6  # visible once publish returned
    client.close()


def test_bad_requests_are_refused_with_a_reason(served) -> None:
    core, server = served
    client = IndexClient(server.address, FAST)
    stub = pb_grpc.CoordinatorIndexStub(grpc.insecure_channel(server.address))
    with pytest.raises(grpc.RpcError) as err:
        stub.LookupPrefix(pb.JoinedKeys(keys=b"\1" * 33))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a whole number" in err.value.details()
    good = encode_publish("node-a", make_entries("node-a", make_chain(3, "x")))
    for damage in ("short_keys", "sizes", "root_index", "negative_size", "empty_node"):
        msg = pb.PublishRequest()
        msg.CopyFrom(good)
        if damage == "short_keys":
            msg.keys = msg.keys[:-1]
        elif damage == "sizes":
            msg.nbytes = msg.nbytes[:8]
        elif damage == "root_index":
            msg.root_of_entry = b"\5\0\0\0" * 3
        elif damage == "negative_size":
            msg.nbytes = (-1).to_bytes(8, "little", signed=True) * 3
        else:
            msg.node_id = ""
        with pytest.raises(grpc.RpcError) as err:
            stub.Publish(msg)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, damage
    assert core.lookup_prefix(make_chain(3, "x")).num_blocks == 0  # nothing half-written
    with pytest.raises(InvalidRequest):
        client.lookup_prefix([b"\1" * 31])


def test_a_token_is_required_when_configured() -> None:
    core = CoordinatorCore(KVStoreConfig(), clock=FakeClock())
    server = IndexServer(core, ServerConfig(auth_token="s3cret"), 0)
    server.start()
    try:
        chain = make_chain(2, "auth")
        with pytest.raises(Unauthenticated):
            IndexClient(server.address, FAST).publish("n", make_entries("n", chain))
        with pytest.raises(Unauthenticated):
            IndexClient(server.address, ClientConfig(auth_token="wrong")).lookup_prefix(chain)
        ok = IndexClient(server.address, ClientConfig(auth_token="s3cret"))
        ok.publish("n", make_entries("n", chain))
        assert ok.lookup_prefix(chain).num_blocks == 2
    finally:
        server.stop()


@pytest.mark.parametrize("holders", [[], [[]], [["a"], ["a"], ["a", "b"], [], ["b"], ["a"]]])
def test_holder_and_publish_codecs_round_trip(holders: list[list[str]]) -> None:
    assert decode_holders(encode_holders(holders)) == holders
    entries = make_entries("n", make_chain(4, "codec"))
    assert decode_publish(encode_publish("n", entries)) == entries
    bad = encode_holders([["a"]])
    bad.set_of_key = b"\7\0\0\0"
    with pytest.raises(ValueError, match="malformed"):
        decode_holders(bad)


def test_fast_path_resolves_once_and_again_after_a_failure(served) -> None:
    _, server = served
    clock = FakeClock()
    asked: list[int] = []

    def resolve() -> str | None:
        asked.append(1)
        return server.address

    fast = FastPath(resolve, FAST, retry_s=5.0, clock=clock)
    first = fast.client()
    assert first is not None and fast.client() is first and len(asked) == 1
    fast.failed(first)
    clock.now += 10
    assert fast.client() is not first and len(asked) == 2  # re-resolved at once
    fast.failed(fast.client())  # type: ignore[arg-type]
    assert fast.client() is None and len(asked) == 2  # not again within retry_s
    clock.now += 5
    assert fast.client() is not None and len(asked) == 3
    off = FastPath(lambda: None, FAST)
    assert off.client() is None  # the service is off: callers use the actor
    assert off.attempt(lambda c: c.lookup_prefix([])) is NO_ANSWER
    clock.now += 5
    working = fast.client()
    assert fast.attempt(lambda c: c.holders(make_chain(1, "none"))) == [[]]

    def unreachable(client: IndexClient) -> None:
        raise NodeUnavailable("gone")

    assert fast.attempt(unreachable) is NO_ANSWER  # and the client is dropped
    assert fast.client() is not working

    def broken() -> str:
        raise RuntimeError("actor restarting")

    assert FastPath(broken, FAST).client() is None


def test_an_unreachable_service_is_node_unavailable() -> None:
    with pytest.raises(NodeUnavailable):
        IndexClient("127.0.0.1:1", ClientConfig(timeout_s=2)).lookup_prefix(
            make_chain(1, "nowhere"))


def _start_actor(config: KVStoreConfig):
    import ray

    from kvstore.coordinator.actor import Coordinator

    return ray.remote(Coordinator).options(
        max_restarts=-1, max_task_retries=-1, num_cpus=0, max_concurrency=8).remote(config)


@pytest.mark.ray
def test_the_actor_and_its_service_give_the_same_answers(ray_local: None) -> None:
    import ray

    from kvstore.coordinator.index_proxy import CoordinatorIndex

    handle = _start_actor(KVStoreConfig())
    off = _start_actor(KVStoreConfig(coordinator=CoordinatorConfig(index_port=None)))
    try:
        assert ray.get(off.index_address.remote()) is None
        chain = make_chain(8, uuid.uuid4().hex)
        for h in (handle, off):
            ray.get(h.register_node.remote("a", NodeAddress("a", "a:1"), 1000, []))
        node_side = FastPath(lambda: ray.get(handle.index_address.remote()), FAST).client()
        assert node_side is not None
        node_side.publish("a", make_entries("a", chain[:5]))  # as a store node publishes
        ray.get(off.publish.remote("a", make_entries("a", chain[:5])))
        answers = []
        for h, fast in ((handle, True), (handle, False), (off, True)):
            index = CoordinatorIndex(h, FAST, fast_path=fast)
            answers.append((index.lookup_prefix(chain), index.holders(chain)))
            index.close()
        assert answers[0] == answers[1] == answers[2]
        assert answers[0][0].num_blocks == 5
    finally:
        ray.kill(handle, no_restart=True)
        ray.kill(off, no_restart=True)


@pytest.mark.ray
def test_a_restarted_coordinator_is_found_on_its_new_port(ray_local: None) -> None:
    import ray

    from kvstore.coordinator.index_proxy import CoordinatorIndex

    handle = _start_actor(KVStoreConfig())
    try:
        chain = make_chain(4, uuid.uuid4().hex)
        index = CoordinatorIndex(handle, FAST)
        ray.get(handle.register_node.remote("a", NodeAddress("a", "a:1"), 1000,
                                            make_entries("a", chain)))
        assert index.lookup_prefix(chain).num_blocks == 4
        old = ray.get(handle.index_address.remote())
        ray.kill(handle, no_restart=False)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if ray.get(handle.index_address.remote()) != old:
                    break
            except ray.exceptions.RayActorError:
                pass
            time.sleep(0.05)
        ray.get(handle.register_node.remote("a", NodeAddress("a", "a:1"), 1000,
                                            make_entries("a", chain[:2])))
        # the first lookup finds the old port dead and asks the actor; later ones re-resolve
        assert index.lookup_prefix(chain).num_blocks == 2
        assert index.lookup_prefix(chain).num_blocks == 2
        index.close()
    finally:
        ray.kill(handle, no_restart=True)
