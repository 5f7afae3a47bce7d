"""Twelve attacks, one numbered row each (Row 1 .. Row 12 in the tests' docstrings), against a
cluster started the documented way.

The cluster is the session's namespace cluster (Ray with token auth on h0..h2, Redis and
``kvstore start`` on h0: secure by default, its secrets made by ``kvstore start`` itself). The
attacker is a fourth host on the same bridge that is not part of the Ray cluster; per test it
holds no credential, a wrong token, a forged credential, tenant B's credential, or tenant A's
valid write credential (and tenant A's key). Its code is tests/multihost/attacker.py: raw gRPC
stubs and raw sockets, never kvstore's client.

Every test checks three things: the attack is refused with the status the product gives;
nothing is lost for the legitimate readers (tenant A's blocks stay held, indexed and
readable); and, where a job runs, its outputs equal the ``--no-cache`` reference. Each refusal
is paired with a control that shows the same probe succeeding where it should (an admin read
finds the blocks and the token ids in them), so no check here passes because it cannot fail.
"""

from __future__ import annotations

import json
import math
import secrets
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.block import block_nbytes
from kvstore.keys import BlockHasher, Namespace
from tests.multihost import attacker as wire
from tests.multihost import attacker_bulk
from tests.multihost.attack_host import (
    BridgeCapture,
    attack,
    attack_async,
    cmdlines_in,
    tcp_payload,
    usage,
)
from tests.multihost.attack_scene import (
    ADMIN_RPCS,
    BULK_FORBIDDEN,
    BULK_OK,
    BULK_UNAUTHENTICATED,
    DEFAULTS,
    DENIED,
    OUTCOMES,
    TENANT_A,
    TENANT_B,
    UNAUTHENTICATED,
    MiB,
    Scene,
    admin_bulk,
    assert_a_intact,
    grow,
    leaks,
    note,
    scene_on,
    wait_until,
    write_outcomes,
)
from tests.multihost.conftest import make_prompts
from tests.multihost.harness import (
    REDIS_PORT,
    RayCluster,
    kvstore_generate,
    kvstore_status,
    probe,
)

pytestmark = [pytest.mark.netns, pytest.mark.timeout(600)]

@pytest.fixture(scope="module", autouse=True)
def outcomes_log() -> Iterator[dict[str, object]]:
    yield OUTCOMES
    write_outcomes()


@pytest.fixture(scope="module")
def scene(kvstore_cluster: RayCluster, work_dir: Path, prompt_files: dict[str, Path],
          reference: dict[str, list[int]], job_config: Path) -> Iterator[Scene]:
    """Tenant A's prompts run as a job, the secrets `kvstore start` made, the nodes'
    addresses, and the attacker host with its credentials (attack_scene.scene_on)."""
    with scene_on(kvstore_cluster, work_dir, prompt_files, reference, job_config) as s:
        yield s


# --- the table ----------------------------------------------------------------------------------

def test_cluster_started_the_documented_way_is_secure(scene: Scene) -> None:
    """The premise of every row: `kvstore status` reports auth, TLS, tenant checks and keyed
    namespaces on, and not insecure."""
    sec = kvstore_status(scene.cluster).get("security", {})
    note("0 status", security=sec)
    assert {k: sec.get(k) for k in ("auth", "tls", "tenant_enforcement", "keyed_namespaces",
                                    "insecure")} == {"auth": True, "tls": True,
                                                     "tenant_enforcement": True,
                                                     "keyed_namespaces": True,
                                                     "insecure": False}, sec


@pytest.mark.parametrize("who", ["none", "wrong", "forged"])
def test_every_rpc_without_valid_credentials_is_unauthenticated(scene: Scene, who: str) -> None:
    """Row 1: Health, Stats, ListKeys, Exists, Get, Lease, Put, Delete, Evict (and the rest)
    with no credential, a random token, or a credential signed under another token."""
    got = attack(scene.attacker, "rpc_matrix", target=scene.holder.grpc, ca_pem=scene.ca,
                 token=scene.creds[who], keys=scene.a_keys, namespace=scene.a_ns)
    note(f"1 rpc without credentials ({who})", **{rpc: r["code"] for rpc, r in got.items()})
    assert {rpc: r["code"] for rpc, r in got.items()} == dict.fromkeys(got, UNAUTHENTICATED)
    assert_a_intact(scene)


def test_plaintext_clients_cannot_talk_to_a_node(scene: Scene) -> None:
    """Row 1 with TLS on: a client without TLS gets no gRPC answer and no HTTP/2 at all."""
    got = attack(scene.attacker, "plaintext_probe", target=scene.holder.grpc)
    assert got["health"]["code"] != "OK" and not got["http2_settings"], got
    bulk = attack(scene.attacker, "bulk_read", target=scene.holder.bulk, ca_pem=None,
                  token="", keys=scene.a_keys, namespace=scene.a_ns)
    note("1 plaintext client", grpc=got, bulk=bulk)
    assert bulk.get("status") != BULK_OK and not leaks(bulk["raw_hex"], scene.a_tokens), bulk


@pytest.mark.parametrize("who", ["none", "wrong", "forged"])
def test_bulk_read_without_valid_token_returns_no_block(scene: Scene, who: str) -> None:
    """Row 2: a bulk read with an empty, random or forged token gets a refusal, no bytes."""
    control = admin_bulk(scene)
    assert control.get("status") == BULK_OK and None not in control["sizes"], control
    assert leaks(control["raw_hex"], scene.a_tokens)  # the detector sees a real read
    token = scene.creds[who] or ""
    got = attack(scene.attacker, "bulk_read", target=scene.holder.bulk, ca_pem=scene.ca,
                 token=token, keys=scene.a_keys, namespace=scene.a_ns)
    note(f"2 bulk read ({who})", attack=got, control_sizes=control["sizes"])
    assert got.get("status") == BULK_UNAUTHENTICATED, got
    assert "sizes" not in got and not leaks(got["raw_hex"], scene.a_tokens)


def test_tenant_b_cannot_read_tenant_a(scene: Scene) -> None:
    """Row 3: tenant B lists, gets, tests, leases and bulk-reads tenant A's blocks, naming A's
    namespace, its own, or none: refused or absent, and A's token ids never come back."""
    control = attack(scene.attacker, "reads", target=scene.holder.grpc, ca_pem=scene.ca,
                     token=scene.creds["a"], keys=scene.a_keys, namespace=scene.a_ns)
    assert control["Get"] == {"code": "OK", "found": len(scene.a_keys)}, control["Get"]
    assert leaks(control["raw_hex"], scene.a_tokens)  # A's own reader does see them

    b = scene.creds["b"]
    as_a = attack(scene.attacker, "reads", target=scene.holder.grpc, ca_pem=scene.ca,
                  token=b, keys=scene.a_keys, namespace=scene.a_ns)
    for rpc in ("Get", "Exists", "Lease", "ListKeys"):
        assert as_a[rpc]["code"] == DENIED, (rpc, as_a[rpc])
    as_b = attack(scene.attacker, "reads", target=scene.holder.grpc, ca_pem=scene.ca,
                  token=b, keys=scene.a_keys, namespace=scene.ns(TENANT_B))
    assert as_b["Get"] == {"code": "OK", "found": 0}, as_b["Get"]
    assert as_b["Exists"] == {"code": "OK", "present": 0}, as_b["Exists"]
    assert as_b["Lease"]["code"] == "OK" and as_b["Lease"]["locations"] == 0, as_b["Lease"]
    unnamed = attack(scene.attacker, "reads", target=scene.holder.grpc, ca_pem=scene.ca,
                     token=b, keys=scene.a_keys, namespace=None)
    for rpc in ("Get", "Exists", "Lease"):
        assert unnamed[rpc]["code"] != "OK" or not any(
            unnamed[rpc].get(f) for f in ("found", "present", "locations")), (rpc, unnamed)
    for got in (as_a, as_b, unnamed):
        assert not leaks(got["raw_hex"], scene.a_tokens)

    bulk = {name: attack(scene.attacker, "bulk_read", target=scene.holder.bulk,
                         ca_pem=scene.ca, token=b, keys=scene.a_keys, namespace=ns)
            for name, ns in (("a", scene.a_ns), ("b", scene.ns(TENANT_B)), ("none", None))}
    assert bulk["a"].get("status") == BULK_FORBIDDEN, bulk["a"]
    assert bulk["b"].get("status") == BULK_OK and set(bulk["b"]["sizes"]) == {None}, bulk["b"]
    assert bulk["none"].get("status") != BULK_OK or set(bulk["none"]["sizes"]) == {None}
    assert not any(leaks(r["raw_hex"], scene.a_tokens) for r in bulk.values())
    note("3 tenant B reads A", naming_a=as_a, naming_b=as_b, naming_none=unnamed, bulk=bulk,
         control_a_get=control["Get"])
    assert_a_intact(scene)


@pytest.mark.parametrize("who", ["a", "b"])
def test_tenant_credentials_cannot_list_delete_or_evict(scene: Scene, who: str) -> None:
    """Row 4: a tenant credential (B on A's blocks, and A on its own) calls the admin RPCs:
    ListKeys, Delete, Evict, Stats, ReportReads are PERMISSION_DENIED; nothing is gone."""
    got = attack(scene.attacker, "rpc_matrix", target=scene.holder.grpc, ca_pem=scene.ca,
                 token=scene.creds[who], keys=scene.a_keys, namespace=scene.a_ns)
    note(f"4 admin RPCs as tenant {who}", **{rpc: got[rpc]["code"] for rpc in got})
    assert {rpc: got[rpc]["code"] for rpc in ADMIN_RPCS} == dict.fromkeys(ADMIN_RPCS, DENIED)
    assert_a_intact(scene)


def test_planted_public_prompt_is_missed_and_outputs_equal_no_cache(
        scene: Scene, work_dir: Path, prompt_files: dict[str, Path],
        reference: dict[str, list[int]], job_config: Path) -> None:
    """Row 5: the attacker computes the keys of a public system prompt under the default salt
    and the public (unkeyed) root, and Puts KV of its own there first, on every node: with no
    credential, and with tenant A's valid write credential (in the default namespace, and in
    A's namespace with the public root). A victim job then prefills that prompt: it finds
    nothing of the attacker's and its outputs equal --no-cache."""
    public = scene.ns("")
    system = make_prompts()["plant"][0]["token_ids"][:96]
    attempts = {}
    for node in scene.nodes:
        for who, ns, root in (("none", public, None), ("a", public, None),
                              ("a", scene.a_ns, wire.public_root(public).hex())):
            got = attack(scene.attacker, "put_blocks", target=node.grpc, ca_pem=scene.ca,
                         token=scene.creds[who], namespace=ns, token_ids=system, root_hex=root)
            attempts[(node.host.name, who, ns["cache_salt"])] = got
    planted = set(next(iter(attempts.values()))["keys"])
    # The plant is aimed right: these are the keys a victim without the cluster's data key
    # would look up (the product's own hasher, public root), and a keyed victim's are others.
    public_ns = Namespace(**public)
    assert planted == {k.hex() for k in BlockHasher(public_ns).block_keys(system)}
    victim_keys = {k.hex() for k in BlockHasher(Namespace(
        **public, data_key=bytes.fromhex(scene.secrets.data_key))).block_keys(system)}
    assert len(victim_keys) == len(planted) == 6 and not victim_keys & planted
    codes = {k: v["code"] for k, v in attempts.items()}
    note("5 plant a public prompt", **{"/".join(k): v for k, v in codes.items()})
    for (host, who, salt), code in codes.items():
        want = {UNAUTHENTICATED} if who == "none" else \
            {DENIED} if salt == "" else {"INVALID_ARGUMENT"}
        assert code in want, (host, who, salt, attempts[(host, who, salt)])

    rows = kvstore_generate(scene.cluster, prompt_files["plant"], work_dir / "victim.jsonl",
                            config=job_config)
    assert [r["output_token_ids"] for r in rows] == [reference[r["id"]] for r in rows]
    assert rows[0]["cached_tokens"] == 0, rows[0]  # nothing of the plant was a hit
    held = {k for n in probe(scene.cluster, "snapshot").values() for k in n["held"]}
    assert not planted & held
    # The victim did cache, under its keyed keys: the cluster was there to be poisoned.
    assert victim_keys <= held, sorted(victim_keys - held)
    OUTCOMES["5 plant a public prompt"]["victim"] = [  # type: ignore[index]
        {k: r.get(k) for k in ("id", "cached_tokens", "sources")} for r in rows]


def test_put_declaring_a_huge_block_is_refused_before_allocation(scene: Scene) -> None:
    """Row 6: a few-hundred-byte Put declaring a 512 MiB block (in a namespace whose block is
    that big, and in A's namespace whose block is not), and a 192 MiB one (under
    server.max_block_bytes: in a namespace whose block is that big, and in A's): refused, the
    node's RSS unchanged."""
    huge_ns = {**scene.a_ns, "num_layers": 64, "block_size": 16, "num_kv_heads": 256,
               "head_dim": 256}  # 2^27 float32 values: a 512 MiB payload
    big_ns = {**huge_ns, "num_layers": 24}  # a 192 MiB payload
    big = block_nbytes(Namespace(**big_ns, tenant_key=bytes.fromhex(scene.tenant_key)))
    cases = {"huge_namespace": (huge_ns, 512 * MiB + 4096), "a_namespace": (scene.a_ns,
                                                                           512 * MiB + 4096),
             "big_namespace": (big_ns, big), "a_namespace_big": (scene.a_ns, big)}
    before = usage(scene.holder.pid)
    results = {name: attack(scene.attacker, "huge_put", target=scene.holder.grpc,
                            ca_pem=scene.ca, token=scene.creds["a"], namespace=ns,
                            total_nbytes=total, data_bytes=64, requests=2)
               for name, (ns, total) in cases.items()}
    after = usage(scene.holder.pid)
    note("6 huge block Put", rss_growth_bytes=after.rss_bytes - before.rss_bytes, **results)
    for got in results.values():
        assert got["message_bytes"] < 1024
        for r in got["requests"]:
            assert r["code"] in ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"), r
    rss, _ = grow(before, after)
    assert rss < 64 * MiB, f"node RSS grew {rss / MiB:.0f} MiB over 8 refused Puts"
    assert_a_intact(scene)


def test_bulk_connection_flood_is_capped(scene: Scene) -> None:
    """Row 7: 300 bulk connections, half declaring the largest credential and a body just
    under the 256 KiB cap and sending all of it with junk for a credential, half silent after
    the TLS handshake: the node admits at most its per-peer cap, buffers no body, its threads
    and RSS stay bounded, and a legitimate reader on another connection is served."""
    before = usage(scene.holder.pid)
    flood = attack_async(scene.attacker, "bulk_flood", target=scene.holder.bulk,
                         ca_pem=scene.ca, connections=300,
                         body_bytes=attacker_bulk.BULK_MAX_BODY - 1, hold_s=60.0)
    try:
        opened = flood.ready(timeout=150)
        during = usage(scene.holder.pid)
        legit = admin_bulk(scene)
        legit_grpc = wire.exists(scene.holder.grpc, scene.ca, scene.admin, scene.a_keys,
                                 scene.a_ns)
    finally:
        result = flood.finish(timeout=120)
    # Once the attacker is gone the node gives its threads and memory back: every connection
    # thread ends by the header deadline.
    freed = wait_until(lambda: usage(scene.holder.pid),
                        lambda u: u.threads <= before.threads + 4,
                        timeout=DEFAULTS.bulk_header_timeout_s + 20)
    rss, threads = grow(before, during)
    note("7 bulk flood", opened=opened, result=result, rss_growth_bytes=rss,
         thread_growth=threads, legit_bulk_status=legit.get("status"),
         legit_grpc=legit_grpc["code"], after_threads=freed.threads - before.threads,
         after_rss_growth_bytes=freed.rss_bytes - before.rss_bytes)
    assert freed.threads <= before.threads + 4, (before, freed)
    assert freed.rss_bytes - before.rss_bytes < 64 * MiB, (before, freed)
    assert legit.get("status") == BULK_OK and None not in legit["sizes"], legit
    assert legit_grpc["code"] == "OK" and all(legit_grpc["present"]), legit_grpc
    assert threads <= DEFAULTS.max_bulk_connections_per_peer + 8, (threads, opened, result)
    assert rss < 128 * MiB, f"node RSS grew {rss / MiB:.0f} MiB under {opened}"
    assert_a_intact(scene)


def test_stalled_put_streams_are_cancelled_and_reads_keep_working(scene: Scene) -> None:
    """Row 8: eight Put streams (tenant A's credential) that stall after one message: the node
    keeps serving reads meanwhile and ends every stream itself (put_idle_timeout_s)."""
    nbytes = wire.exists(scene.holder.grpc, scene.ca, scene.admin, scene.a_keys[:1],
                         scene.a_ns)["nbytes"][0]
    stall = attack_async(scene.attacker, "stalled_puts", target=scene.holder.grpc,
                         ca_pem=scene.ca, token=scene.creds["a"], streams=8,
                         namespace=scene.a_ns, total_nbytes=nbytes, first_bytes=100,
                         hold_s=DEFAULTS.put_idle_timeout_s + 30)
    try:
        stall.ready()
        for _ in range(3):
            assert wire.health(scene.holder.grpc, scene.ca, scene.admin)["code"] == "OK"
            assert_a_intact(scene)
            assert admin_bulk(scene).get("status") == BULK_OK
        control = attack(scene.attacker, "reads", target=scene.holder.grpc, ca_pem=scene.ca,
                         token=scene.creds["a"], keys=scene.a_keys, namespace=scene.a_ns)
        assert control["Get"] == {"code": "OK", "found": len(scene.a_keys)}
    finally:
        result = stall.finish(release=False, timeout=DEFAULTS.put_idle_timeout_s + 90)
    note("8 stalled Put streams", streams=result["streams"])
    for stream in result["streams"]:
        assert stream["code"] != "OK" and stream["ended_by_node"], result["streams"]
    # Those the node admitted (past server.max_concurrent_puts they are Overloaded at once) it
    # cancelled itself when they stayed silent.
    assert any(r["code"] == "CANCELLED" for r in result["streams"]), result["streams"]


def test_stalled_reservation_evicts_no_committed_block(scene: Scene, work_dir: Path) -> None:
    """Row 9: Puts of 62 MiB blocks (tenant A's credential) that send all but the last byte
    and stall, four at once (more than the 256 MiB pool has free): whatever the node buffers
    of them, the coordinator evicts no committed block while they hang, or after."""
    before = probe(scene.cluster, "snapshot")
    path = work_dir / "snapshot-reservation.json"
    path.write_text(json.dumps(before))
    big_ns = {**scene.a_ns, "num_layers": 496, "block_size": 16, "num_kv_heads": 8,
              "head_dim": 128}  # 62 MiB payload
    total = block_nbytes(Namespace(**big_ns, tenant_key=bytes.fromhex(scene.tenant_key)))
    stall = attack_async(scene.attacker, "stalled_puts", target=scene.holder.grpc,
                         ca_pem=scene.ca, token=scene.creds["a"], streams=4, namespace=big_ns,
                         total_nbytes=total, first_bytes=total - 1,
                         hold_s=DEFAULTS.put_idle_timeout_s + 30)
    try:
        ready = stall.ready()
        # A few heartbeats (1 s each) while the reservations hang: evictions would show now.
        time.sleep(4.0)
        during = probe(scene.cluster, "wait-healthy", "--nodes", str(len(scene.nodes)),
                       "--before", str(path), "--timeout", "5")
        assert_a_intact(scene)
    finally:
        result = stall.finish(timeout=DEFAULTS.put_idle_timeout_s + 90)
    note("9 stalled reservation", ready=ready, streams=result["streams"],
         lost_during=during.get("lost"))
    # The attack got in: at least one stream was admitted with all but a byte of its block
    # and held until the node's watchdog cancelled it (the rest may be refused at once by the
    # node's bounds on unfinished Puts).
    assert any(r["code"] == "CANCELLED" and r["ended_by_node"] for r in result["streams"]), \
        result["streams"]
    assert during["ok"], f"committed blocks lost while reservations hung: {during.get('lost')}"
    after = probe(scene.cluster, "wait-healthy", "--nodes", str(len(scene.nodes)),
                  "--before", str(path), "--timeout", "5")
    assert after["ok"], f"committed blocks lost: {after.get('lost')} ({result})"


def test_lease_ttl_is_clamped_and_lease_ids_are_bound_to_their_caller(scene: Scene) -> None:
    """Row 10: Leases with ttl inf, nan, 1e12 or negative are clamped or refused; a legitimate
    reader's lease cannot be released or renewed by another client, by its id or by guesses."""
    victim = wire.take_lease(scene.holder.grpc, scene.ca, scene.admin, scene.a_keys[:1],
                             scene.a_ns, 30.0)
    assert victim["code"] == "OK" and victim["locations"] == 1, victim
    got = attack(scene.attacker, "lease_attacks", target=scene.holder.grpc, ca_pem=scene.ca,
                 token=scene.creds["a"], keys=scene.a_keys[:1], namespace=scene.a_ns,
                 victim_lease_id=victim["lease_id"])
    note("10 leases", ttls=got["ttls"], release_victim=got["release_victim"],
         renew_victim=got["renew_victim"],
         release_guesses=sorted({r["code"] for r in got["release_guesses"].values()}))
    for name, r in got["ttls"].items():
        assert r["code"] != "OK" or (math.isfinite(r["expires_in_s"])
                                     and r["expires_in_s"] <= DEFAULTS.max_lease_ttl_s + 5), \
            (name, r)
    ids = [i for i in got["own_ids"] if i]
    assert ids and all(len(i) >= 16 and not i.isdigit() for i in ids + [victim["lease_id"]]), ids
    assert got["renew_victim"]["code"] != "OK", got["renew_victim"]
    # The release by id and every guess was refused or ignored: the victim's lease renews.
    renewed = wire.renew_lease(scene.holder.grpc, scene.ca, scene.admin, victim["lease_id"], 30.0)
    assert renewed["code"] == "OK", (renewed, got["release_victim"])
    assert_a_intact(scene)


@pytest.mark.parametrize("unary", [True, False], ids=["PutBatch", "Put-stream"])
def test_valid_block_followed_by_junk_is_refused(scene: Scene, unary: bool) -> None:
    """Row 11: tenant A's writer Puts blocks valid in every respect (its key, its MAC) but each
    followed by 8 MiB of junk: refused, nothing stored. The same blocks without junk store."""
    rng = struct.unpack("<32H", secrets.token_bytes(64))
    tokens = [1 + t % 400 for t in rng]  # two fresh blocks nobody has written
    kw = {"target": scene.holder.grpc, "ca_pem": scene.ca, "token": scene.creds["a"],
          "namespace": scene.a_ns, "tenant_key_hex": scene.tenant_key, "token_ids": tokens,
          "unary": unary}
    junk = attack(scene.attacker, "put_tenant_blocks", junk_bytes=8 * MiB, **kw)
    note(f"11 valid block + junk ({'PutBatch' if unary else 'Put stream'})",
         junk={k: junk.get(k) for k in ("code", "details")})
    assert junk["code"] in ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"), junk
    stored = wire.exists(scene.holder.grpc, scene.ca, scene.admin, junk["keys"], scene.a_ns)
    assert stored["code"] == "OK" and not any(stored["present"]), stored
    clean = attack(scene.attacker, "put_tenant_blocks", junk_bytes=0, **kw)
    OUTCOMES[f"11 valid block + junk ({'PutBatch' if unary else 'Put stream'})"][  # type: ignore[index]
        "control_without_junk"] = {k: clean.get(k) for k in ("code", "stored", "existing")}
    assert clean["code"] == "OK" and clean["stored"] + clean["existing"] == 2, clean
    assert_a_intact(scene)


def test_secrets_are_not_in_argv_nor_plaintext_on_the_wire(scene: Scene) -> None:
    """Row 12: no process of the cluster's hosts carries the cluster token, the data key, the
    Redis password or a credential in its argv; what crosses the bridge while a client
    presents them is ciphertext; Redis answers no plaintext client."""
    sec = scene.secrets
    secret_values = {"cluster token": sec.token, "data key": sec.data_key,
                     "redis password": sec.redis_password or scene.cluster.redis_password,
                     "tenant A credential": scene.creds["a"], "tenant A key": scene.tenant_key}
    argv = cmdlines_in(scene.cluster.net.hosts)
    assert argv, "no process found in the hosts"
    for what, value in secret_values.items():
        assert value, what
        hits = {pid: cmd[:200] for pid, cmd in argv.items() if value in cmd}
        assert not hits, f"the {what} is in argv: {hits}"

    capture = BridgeCapture(scene.cluster.net.bridge)
    try:
        assert wire.health(scene.holder.grpc, scene.ca, sec.token)["code"] == "OK"
        read = wire.bulk_read(scene.holder.bulk, scene.ca, scene.creds["a"], scene.a_keys,
                              scene.a_ns, expect_bytes=16 * MiB)
        assert read.get("status") == BULK_OK, read
    finally:
        frames = capture.stop()
    grpc_bytes = tcp_payload(frames, int(scene.holder.grpc.rpartition(":")[2]))
    bulk_bytes = tcp_payload(frames, int(scene.holder.bulk.rpartition(":")[2]))
    assert len(grpc_bytes) > 200 and len(bulk_bytes) > 1000  # the capture saw both
    for what, value in secret_values.items():
        assert value.encode() not in grpc_bytes + bulk_bytes, f"the {what} crossed in clear"
    assert not leaks((grpc_bytes + bulk_bytes).hex(), scene.a_tokens)

    redis = attack(scene.attacker, "redis_plaintext",
                   target=f"{scene.cluster.head.ip}:{REDIS_PORT}")
    note("12 secrets", argv_processes=len(argv), grpc_bytes_seen=len(grpc_bytes),
         bulk_bytes_seen=len(bulk_bytes), redis_plaintext=redis)
    assert not redis.get("resp"), f"Redis answered a plaintext client: {redis}"


def test_legitimate_readers_lost_nothing(scene: Scene, work_dir: Path,
                                         prompt_files: dict[str, Path],
                                         reference: dict[str, list[int]],
                                         job_config: Path) -> None:
    """After every attack: tenant A's blocks are all still held and indexed, and A's job runs
    its prompts again wholly from them, with outputs equal to --no-cache."""
    snap = probe(scene.cluster, "snapshot")
    holder = next(n for n in snap.values() if n["ip"] == scene.holder.host.ip)
    assert set(scene.a_keys) <= set(holder["held"]) & set(holder["indexed"])
    rows = kvstore_generate(scene.cluster, prompt_files["tenant"], work_dir / "tenant-a-2.jsonl",
                            config=job_config, salt=TENANT_A)
    assert [r["output_token_ids"] for r in rows] == [reference[r["id"]] for r in rows]
    note("13 legitimate readers", rows=[{k: r.get(k) for k in ("id", "cached_tokens",
                                                                  "sources")} for r in rows])
    assert all(r["cached_tokens"] >= 96 and r["sources"] for r in rows), rows
