"""Which tenants a vLLM instance serves from kvstore, and with which key.

An instance inside the cluster's trust (started by the operator) uses the cluster's data key:
every request's ``cache_salt`` is its tenant, as in kvstore's own engine. An instance run by one
tenant holds that tenant's credential instead (``kvstore credentials issue``), given as
``kv_connector_extra_config.credential`` or ``KVSTORE_CLIENT_AUTH_TOKEN``: the store nodes
enforce it on every block, so the connector maps requests onto it up front. A request with no
``cache_salt`` or with the credential's own tenant uses that tenant's namespace (keyed with its
tenant key: ``tenant_key``, ``KVSTORE_TENANT_KEY``, or derived from the data key where the
instance has it); a request naming another tenant is served without the cache (no lookup, no
save) rather than refused by the node, so it still gets its answer, computed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstore.errors import ConfigError
from kvstore.security.data_keys import check_tenant_key, tenant_key
from kvstore.security.grants import ANY, PREFIX, inspect_credential

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tenancy:
    """The instance's tenants: every salt (``tenant`` None), or one tenant's."""

    data_key: bytes | None = None
    tenant: str | None = None
    tenant_key: bytes | None = None
    may_write: bool = True

    def salt_for(self, cache_salt: str | None) -> str | None:
        """The namespace salt of a request, or None where this instance may not cache it."""
        if self.tenant is None:
            return cache_salt or ""
        if cache_salt in (None, "", self.tenant):
            return self.tenant
        return None

    def keys(self) -> dict[str, bytes | None]:
        """The key arguments of the tenant's namespaces (``Namespace`` takes one of them)."""
        if self.tenant is not None:
            return {"tenant_key": self.tenant_key}
        return {"data_key": self.data_key}


def tenancy(extra: Mapping[str, Any], credential: str | None, data_key: bytes | None,
            env: Mapping[str, str] | None = None) -> Tenancy:
    """The instance's tenancy from its credential (a tenant's, or the cluster token)."""
    env = os.environ if env is None else env
    if not credential or not credential.startswith(PREFIX):
        return Tenancy(data_key=data_key)  # the cluster token, or none (a loopback cluster)
    grant = inspect_credential(credential)
    if grant.admin:
        return Tenancy(data_key=data_key)
    tenant = extra.get("tenant")
    if tenant is None:
        named = sorted((grant.write or grant.read) - {ANY})
        if len(named) != 1:
            raise ConfigError(
                f"credential {grant.subject!r} grants {len(named)} tenants: set "
                "kv_connector_extra_config.tenant to the cache salt this instance serves")
        tenant = named[0]
    tenant = str(tenant)
    if not grant.may_read(tenant):
        raise ConfigError(f"credential {grant.subject!r} may not read tenant {tenant!r}")
    key_hex = extra.get("tenant_key") or env.get("KVSTORE_TENANT_KEY")
    if key_hex:
        try:
            key: bytes | None = check_tenant_key(bytes.fromhex(str(key_hex)))
        except ValueError:
            raise ConfigError("tenant_key must be the hex key `kvstore credentials issue "
                              "--tenant-key` printed") from None
    elif data_key is not None:
        key = tenant_key(data_key, tenant)
    else:
        key = None  # an insecure cluster: public roots, nothing to key
    if not grant.may_write(tenant):
        log.info("credential %r reads tenant %r only: this instance loads, never saves",
                 grant.subject, tenant)
    return Tenancy(tenant=tenant, tenant_key=key, may_write=grant.may_write(tenant))
