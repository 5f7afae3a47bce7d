"""The global index in Redis, shared by every node of a cluster.

The key layout and the Lua scripts live in ``kvstore.index.redis_layout``. Writes are scripts
(atomic, so a key and its reverse sets never disagree); a batch of more than one script call goes
out as one pipeline, so ``publish`` of any size costs one round trip and returns once every key is
visible. ``lookup_prefix`` is one ``HMGET`` of the holder strings, the floor a lookup can reach
(one round trip, no per-key name building, no script).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.commands.core import Script
from redis.retry import Retry

from kvstore.errors import ConfigError, IndexAuthError, IndexBackendError, IndexUnavailable
from kvstore.index import redis_layout as layout
from kvstore.index.base import IndexEntry, KeyInfo
from kvstore.index.checks import check_entries, check_keys, check_node_id
from kvstore.records import PrefixHit

#: Entries per script call (tests shrink it to exercise several calls per batch).
_CHUNK = layout.CHUNK


def redact_url(url: str) -> str:
    """The URL with its password replaced, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


class RedisIndex:
    """The index in one Redis database, under ``key_prefix`` (several clusters may share one)."""

    def __init__(self, url: str, *, key_prefix: str = "kvstore:",
                 ssl_ca_certs: str | None = None, timeout_s: float = 10.0,
                 password: str | None = None, ssl_ca_data: str | None = None) -> None:
        """``password`` (kept out of the URL, so out of argv and logs) wins over one in
        ``url``; ``ssl_ca_certs`` verifies a ``rediss://`` server against a private CA."""
        self.url = redact_url(url)
        self._prefix = key_prefix.encode()
        self._holder_strings = self._prefix + b"hs"
        kwargs: dict[str, Any] = {
            "socket_connect_timeout": timeout_s,
            "socket_timeout": timeout_s,
            # A few quick retries ride over a Redis restart; the default backoff waits seconds.
            "retry": Retry(ExponentialBackoff(cap=0.5, base=0.05), 3),
        }
        if password:
            kwargs["password"] = password
        if ssl_ca_certs is not None or ssl_ca_data is not None:
            if not url.startswith("rediss://"):
                raise ConfigError(f"a CA ({ssl_ca_certs or 'PEM'}) was given for {self.url}, "
                                  "which is not TLS; use a rediss:// URL or drop "
                                  "index.redis_ca_file / redis_ca_pem")
            if ssl_ca_certs is not None:
                kwargs["ssl_ca_certs"] = ssl_ca_certs
            else:
                kwargs["ssl_ca_data"] = ssl_ca_data
        with self._errors():
            try:
                self._r = redis.Redis.from_url(url, **kwargs)
            except ValueError as exc:  # redis-py's message names the bad part of the URL
                raise ConfigError(f"bad Redis URL {self.url}: {exc}") from exc
            self._publish = self._r.register_script(layout.PUBLISH)
            self._touch = self._r.register_script(layout.TOUCH)
            self._remove = self._r.register_script(layout.REMOVE)
            self._drop = self._r.register_script(layout.DROP_NODE)
            # Load now: fails fast on a bad URL or password, and keeps the first write at one
            # round trip (Script would otherwise try EVALSHA, get NOSCRIPT, load, retry).
            for script in (self._publish, self._touch, self._remove, self._drop):
                self._r.script_load(script.script)
        self._check_password_needed(url, kwargs)

    def _check_password_needed(self, url: str, kwargs: dict[str, Any]) -> None:
        """Refuse a password that Redis would ignore: the operator believes the index is private.

        A Redis without ``requirepass`` answers ``AUTH`` with an error that redis-py swallows,
        so ask directly: a password-less connection that may run a command proves it has none.
        """
        parts = urlsplit(url)
        if parts.password is None and not kwargs.get("password"):
            return
        if parts.username not in (None, "", "default"):
            return  # an ACL user name: other users may have passwords even if default has none
        bare = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
        probe = redis.Redis.from_url(bare, **{**kwargs, "retry": None, "password": None})
        try:
            probe.ping()
        except redis.RedisError:
            return  # NOAUTH (or similar): Redis does want the password
        finally:
            probe.close()
        raise IndexAuthError(
            f"Redis index at {self.url}: a password was given but this Redis has none "
            "configured (it accepts any); drop the password (URL, index.redis_password_file, "
            "KVSTORE_INDEX_REDIS_PASSWORD), or set requirepass")

    def publish(self, entries: Sequence[IndexEntry]) -> None:
        """Add holders; visible to every reader when it returns."""
        check_entries(entries)
        now = repr(time.time())
        calls: list[list[Any]] = []
        for i in range(0, len(entries), _CHUNK):
            args: list[Any] = [self._prefix, now]
            for e in entries[i:i + _CHUNK]:
                args += [e.key, e.node_id, e.nbytes, e.parent_key, e.namespace_root]
            calls.append(args)
        self._run(self._publish, calls)

    def lookup_prefix(self, keys: Sequence[bytes]) -> PrefixHit:
        """Leading keys with a holder: one ``HMGET`` of their holder strings."""
        check_keys(keys)
        if not keys:
            return PrefixHit(num_blocks=0, holders=[])
        with self._errors():
            joined = self._r.execute_command("HMGET", self._holder_strings, *keys)
        holders = layout.decode_prefix(joined)
        return PrefixHit(num_blocks=len(holders), holders=holders)

    def holders(self, keys: Sequence[bytes]) -> list[list[str]]:
        """The holders of each key, in one ``HMGET``."""
        check_keys(keys)
        if not keys:
            return []
        with self._errors():
            joined = self._r.execute_command("HMGET", self._holder_strings, *keys)
        return layout.decode_holders(joined)

    def info(self, keys: Sequence[bytes]) -> list[KeyInfo | None]:
        """Everything known about each key (one MULTI, so holders and metadata agree)."""
        check_keys(keys)
        with self._errors():
            pipe = self._r.pipeline(transaction=True)
            for k in keys:
                pipe.hmget(self._prefix + b"m:" + k, "nbytes", "parent", "ns", "last_use")
                pipe.smembers(self._prefix + b"h:" + k)
            replies = pipe.execute()
        out: list[KeyInfo | None] = []
        for k, (nbytes, parent, ns, last_use), h in zip(keys, replies[::2], replies[1::2],
                                                       strict=True):
            if nbytes is None or not h:
                out.append(None)
                continue
            out.append(KeyInfo(k, sorted(n.decode() for n in h), int(nbytes), parent, ns,
                               float(last_use)))
        return out

    def touch(self, keys: Sequence[bytes], now: float | None = None) -> None:
        """Record a use; last use never moves backwards."""
        check_keys(keys)
        t = repr(time.time() if now is None else float(now))
        self._run(self._touch, [[self._prefix, t, *keys[i:i + _CHUNK]]
                                for i in range(0, len(keys), _CHUNK)])

    def remove(self, keys: Sequence[bytes], node_id: str) -> None:
        """``node_id`` no longer holds ``keys``."""
        check_keys(keys)
        check_node_id(node_id)
        self._run(self._remove, [[self._prefix, node_id, *keys[i:i + _CHUNK]]
                                 for i in range(0, len(keys), _CHUNK)])

    def drop_node(self, node_id: str) -> int:
        """Remove a node from every key it held, a bounded batch per script call."""
        check_node_id(node_id)
        total = 0
        with self._errors():
            while True:
                n, left = self._drop(args=[self._prefix, node_id, _CHUNK])
                total += int(n)
                if int(left) == 0:
                    return total

    def set_marker(self, epoch: int) -> None:
        """Write the coordinator's epoch; its absence later means Redis lost its data."""
        with self._errors():
            self._r.set(self._prefix + b"epoch", str(epoch))

    def claim_marker(self, epoch: int) -> bool:
        """Write ``epoch`` only if no marker exists; True when it was missing (data lost)."""
        with self._errors():
            return bool(self._r.set(self._prefix + b"epoch", str(epoch), nx=True))

    def keys_of_node(self, node_id: str) -> list[bytes]:
        """The keys a node holds."""
        with self._errors():
            return self._members(self._prefix + b"n:" + node_id.encode())

    def keys_of_namespace(self, namespace_root: bytes) -> list[bytes]:
        """The keys of one namespace."""
        with self._errors():
            return self._members(self._prefix + b"s:" + namespace_root)

    def nodes(self) -> list[str]:
        """Nodes holding at least one key."""
        with self._errors():
            return sorted(n.decode() for n in self._members(self._prefix + b"nodes"))

    def num_keys(self) -> int:
        """Keys with at least one holder."""
        with self._errors():
            return int(self._r.scard(self._prefix + b"keys"))

    def clear(self) -> None:
        """Delete every Redis key under this index's prefix (and nothing else)."""
        pattern = _glob_escape(self._prefix) + b"*"
        with self._errors():
            batch: list[bytes] = []
            for name in self._r.scan_iter(match=pattern, count=1000):
                batch.append(name)
                if len(batch) >= 1000:
                    self._r.unlink(*batch)
                    batch.clear()
            if batch:
                self._r.unlink(*batch)

    def close(self) -> None:
        """Close the connection pool."""
        self._r.close()

    def _run(self, script: Script, calls: list[list[Any]]) -> None:
        """Run ``script`` once per argument list, all in one round trip.

        Each call stays atomic on its own; the pipeline (no MULTI: nothing is gained by making
        the chunks one transaction) only saves round trips, and returns once Redis has run
        every call, which is what "visible when publish returns" needs.
        """
        with self._errors():
            if len(calls) == 1:
                script(args=calls[0])  # reloads the script itself after a Redis restart
                return
            if not calls:
                return
            for attempt in (0, 1):
                pipe = self._r.pipeline(transaction=False)
                for args in calls:
                    pipe.evalsha(script.sha, 0, *args)
                try:
                    pipe.execute()
                    return
                except redis.exceptions.NoScriptError:
                    if attempt:
                        raise
                    # Redis restarted and forgot the script; every call failed alike and the
                    # scripts are idempotent, so load it and send the batch again.
                    script.sha = self._r.script_load(script.script)

    def _members(self, name: bytes) -> list[bytes]:
        # decode_responses is off (keys are raw bytes), so members are bytes.
        return sorted(cast(set[bytes], self._r.smembers(name)))

    @contextmanager
    def _errors(self) -> Iterator[None]:
        """Turn redis-py's errors into kvstore's, naming the URL but never the password."""
        try:
            yield
        except redis.AuthenticationError as exc:
            raise IndexAuthError(f"Redis index at {self.url} rejected the credentials ({exc}); "
                                 "check the password in the Redis URL") from exc
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise IndexUnavailable(f"Redis index at {self.url} is unreachable ({exc}); check "
                                   "the host and port in the Redis URL and that Redis runs"
                                   ) from exc
        except redis.ResponseError as exc:
            if str(exc).startswith(("NOAUTH", "WRONGPASS")):
                raise IndexAuthError(f"Redis index at {self.url} needs a valid password ({exc}); "
                                     "put it in the URL: redis://:PASSWORD@host:port/0") from exc
            raise IndexBackendError(f"Redis index at {self.url} failed: {exc}") from exc
        except redis.RedisError as exc:
            raise IndexBackendError(f"Redis index at {self.url} failed: {exc}") from exc


def _glob_escape(raw: bytes) -> bytes:
    """Escape Redis glob characters so a prefix like ``a*`` matches only itself."""
    out = bytearray()
    for b in raw:
        if chr(b) in "*?[]\\":
            out.append(ord("\\"))
        out.append(b)
    return bytes(out)
