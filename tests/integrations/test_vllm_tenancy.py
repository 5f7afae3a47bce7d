"""An instance's tenancy: the cluster's data key serves every salt; a tenant's credential maps
requests onto its one tenant, keyed so that its namespaces are the ones every data-key holder
(store nodes, other instances) computes, and leaves other tenants' requests uncached."""

from __future__ import annotations

import pytest

from kvstore.client.local_store import LocalStore
from kvstore.errors import ConfigError
from kvstore.integrations.vllm.namespace import ModelGeometry, namespace
from kvstore.integrations.vllm.scheduler_side import SchedulerSide
from kvstore.integrations.vllm.tenancy import tenancy
from kvstore.security.data_keys import tenant_key
from kvstore.security.grants import issue_credential

TOKEN = "cluster-token-for-tests"
DATA_KEY = bytes(range(32))
GEOMETRY = ModelGeometry("ck", "float32", 4, 1, 1, 2)


def credential(**grants: object) -> str:
    return issue_credential(TOKEN, "team", **grants)  # type: ignore[arg-type]


def test_the_cluster_data_key_serves_every_salt() -> None:
    t = tenancy({}, None, DATA_KEY, env={})
    assert t.salt_for(None) == "" and t.salt_for("b") == "b" and t.may_write
    assert t.keys() == {"data_key": DATA_KEY}
    assert tenancy({}, TOKEN, DATA_KEY, env={}).tenant is None  # the cluster token itself


def test_a_tenant_credential_maps_requests_onto_its_tenant() -> None:
    t = tenancy({}, credential(write=["team-a"]), DATA_KEY, env={})
    assert t.tenant == "team-a" and t.may_write
    assert t.salt_for(None) == t.salt_for("") == t.salt_for("team-a") == "team-a"
    assert t.salt_for("team-b") is None
    mine = namespace(GEOMETRY, "f" * 64, "tag", "team-a", **t.keys())
    theirs = namespace(GEOMETRY, "f" * 64, "tag", "team-a", data_key=DATA_KEY)
    assert mine.root == theirs.root  # the same blocks the nodes and other instances name
    assert t.tenant_key == tenant_key(DATA_KEY, "team-a")


def test_a_tenant_key_given_as_hex_and_a_read_only_credential() -> None:
    key = tenant_key(DATA_KEY, "team-a")
    t = tenancy({}, credential(read=["team-a"]), None, env={"KVSTORE_TENANT_KEY": key.hex()})
    assert t.tenant_key == key and not t.may_write
    with pytest.raises(ConfigError, match="tenant_key must be the hex key"):
        tenancy({"tenant_key": "zz"}, credential(read=["team-a"]), None, env={})


def test_a_credential_of_several_tenants_needs_the_one_this_instance_serves() -> None:
    both = credential(write=["team-a", "team-b"])
    with pytest.raises(ConfigError, match="grants 2 tenants"):
        tenancy({}, both, DATA_KEY, env={})
    assert tenancy({"tenant": "team-b"}, both, DATA_KEY, env={}).tenant == "team-b"
    with pytest.raises(ConfigError, match="may not read tenant 'team-c'"):
        tenancy({"tenant": "team-c"}, both, DATA_KEY, env={})


def test_another_tenants_request_is_neither_looked_up_nor_saved() -> None:
    from types import SimpleNamespace

    t = tenancy({}, credential(write=["team-a"]), DATA_KEY, env={})

    class Watched(LocalStore):
        lookups = 0

        def lookup_prefix(self, ns, keys):  # type: ignore[no-untyped-def]
            Watched.lookups += 1
            return super().lookup_prefix(ns, keys)

    side = SchedulerSide(Watched(), lambda salt: namespace(GEOMETRY, "f" * 64, "tag", salt,
                                                           **t.keys()), 4, salt_for=t.salt_for)
    req = SimpleNamespace(request_id="x", prompt_token_ids=list(range(13)), cache_salt="team-b")
    assert side.matched_tokens(req, 0) == (0, False) and Watched.lookups == 0
    side.allocated(req, [0, 1, 2, 3], 0)
    plan = side.step_plan(SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="x", block_ids=([0, 1, 2, 3],),
                                            num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(),
                                              new_block_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={"x": 13}))
    assert plan.loads == [] and plan.saves == []
