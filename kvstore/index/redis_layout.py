"""How the Redis index lays its data out: the key names, the Lua scripts that write them, and the
codec of the holder strings that a prefix lookup reads.

Layout (``P`` is the key prefix, ``<key>`` the raw 32-byte block key, ``<ns>`` a namespace root):

    P h:<key>   set    the node ids holding the block
    P hs        hash   <key> -> the same ids, sorted, joined by newlines  (lookups read this)
    P m:<key>   hash   nbytes, parent, ns, last_use                       (info, LRU)
    P n:<node>  set    the keys a node holds                 (drop_node, reconciliation)
    P s:<ns>    set    the keys of a namespace               (invalidate --namespace)
    P keys      set    every key with a holder               (num_keys)
    P nodes     set    every node holding a key              (nodes)
    P epoch     string the coordinator's epoch               (notices a Redis that lost its data)

Why ``P hs`` is one hash and not a string per key: a longest-prefix lookup of N keys is then one
``HMGET P hs k1 .. kN`` whose arguments are the caller's keys as they are (no name to build per
key), which costs what one ``MGET`` of N keys costs (bench_transfer, ``ratio_lookup_vs_mget``).

Every write is a Lua script, so a key, its holders, its holder string and the reverse sets never
disagree, even with many writers. The scripts build key names from their arguments, which ties
the index to one Redis instance (or a primary with replicas), not Redis Cluster: a cluster-wide
prefix index is small enough for one primary.
"""

from __future__ import annotations

from collections.abc import Sequence

#: Entries per script call: bounds how long one call blocks Redis for everyone else, and keeps
#: every ``unpack`` below under Lua's 8,000-value stack limit.
CHUNK = 2000

# Keeps the ``hs`` field of a key in step with its ``h:<key>`` set (sorted holders joined by
# newlines), so a lookup reads one short string per key and never sorts.
_SYNC_HOLDERS = """
local function sync_holders(p, key)
  local m = redis.call('SMEMBERS', p .. 'h:' .. key)
  if #m == 0 then
    redis.call('HDEL', p .. 'hs', key)
  else
    table.sort(m)
    redis.call('HSET', p .. 'hs', key, table.concat(m, '\\n'))
  end
end
"""

# Per entry: metadata, holder set, holder string (five calls in the common case of a new key).
# The reverse sets (per node, per namespace, all keys, all nodes) get one SADD per batch, not per
# entry. A key's namespace set is the one of its *last* entry in the batch, as if the entries had
# been published one by one.
PUBLISH = _SYNC_HOLDERS + """
local p, now = ARGV[1], ARGV[2]
local by_node, ns_of, all_keys, all_nodes = {}, {}, {}, {}
for i = 3, #ARGV, 5 do
  local key, node, nbytes, parent, ns = ARGV[i], ARGV[i+1], ARGV[i+2], ARGV[i+3], ARGV[i+4]
  local m = p .. 'm:' .. key
  local old = redis.call('HMGET', m, 'ns', 'last_use')
  if old[1] and old[1] ~= ns then redis.call('SREM', p .. 's:' .. old[1], key) end
  local last_use = now
  if old[2] and tonumber(old[2]) > tonumber(now) then last_use = old[2] end
  redis.call('HSET', m, 'nbytes', nbytes, 'parent', parent, 'ns', ns, 'last_use', last_use)
  local h = p .. 'h:' .. key
  if redis.call('SADD', h, node) == 1 then
    if redis.call('SCARD', h) == 1 then
      redis.call('HSET', p .. 'hs', key, node)
    else
      sync_holders(p, key)
    end
  end
  local ks = by_node[node]
  if not ks then ks = {}; by_node[node] = ks; all_nodes[#all_nodes + 1] = node end
  ks[#ks + 1] = key
  ns_of[key] = ns
  all_keys[#all_keys + 1] = key
end
for node, ks in pairs(by_node) do redis.call('SADD', p .. 'n:' .. node, unpack(ks)) end
local by_ns = {}
for key, ns in pairs(ns_of) do
  local ks = by_ns[ns]
  if not ks then ks = {}; by_ns[ns] = ks end
  ks[#ks + 1] = key
end
for ns, ks in pairs(by_ns) do redis.call('SADD', p .. 's:' .. ns, unpack(ks)) end
if #all_keys > 0 then
  redis.call('SADD', p .. 'keys', unpack(all_keys))
  redis.call('SADD', p .. 'nodes', unpack(all_nodes))
end
return 1
"""

TOUCH = """
local p, now = ARGV[1], ARGV[2]
local t = tonumber(now)
for i = 3, #ARGV do
  local m = p .. 'm:' .. ARGV[i]
  local old = redis.call('HGET', m, 'last_use')
  if old and tonumber(old) < t then redis.call('HSET', m, 'last_use', now) end
end
return 1
"""

# Shared by remove and drop_node: take one holder off one key, delete the key with its last.
_REMOVE_ONE = _SYNC_HOLDERS + """
local function remove_one(p, key, node)
  local h = p .. 'h:' .. key
  if redis.call('SREM', h, node) == 0 then return 0 end
  sync_holders(p, key)
  redis.call('SREM', p .. 'n:' .. node, key)
  if redis.call('EXISTS', h) == 0 then
    local m = p .. 'm:' .. key
    local ns = redis.call('HGET', m, 'ns')
    if ns then redis.call('SREM', p .. 's:' .. ns, key) end
    redis.call('DEL', m)
    redis.call('SREM', p .. 'keys', key)
  end
  return 1
end
"""

REMOVE = _REMOVE_ONE + """
local p, node = ARGV[1], ARGV[2]
local n = 0
for i = 3, #ARGV do n = n + remove_one(p, ARGV[i], node) end
if redis.call('EXISTS', p .. 'n:' .. node) == 0 then redis.call('SREM', p .. 'nodes', node) end
return n
"""

# Pops a bounded batch per call so dropping a node with millions of keys never blocks Redis.
DROP_NODE = _REMOVE_ONE + """
local p, node, batch = ARGV[1], ARGV[2], tonumber(ARGV[3])
local keys = redis.call('SPOP', p .. 'n:' .. node, batch)
local n = 0
for _, key in ipairs(keys) do
  n = n + remove_one(p, key, node)
end
local left = redis.call('SCARD', p .. 'n:' .. node)
if left == 0 then redis.call('SREM', p .. 'nodes', node) end
return {n, left}
"""


def decode_prefix(joined: Sequence[bytes | None]) -> list[list[str]]:
    """The holders of the leading keys whose holder string is present, from one ``HMGET``.

    Python touches each key only through C loops (``index``, ``set``, ``map``): consecutive
    blocks of a prompt nearly always share their holders, so each distinct string is decoded
    once and every key gets its own copy of that list (callers may keep or change theirs).
    """
    try:
        hit = joined[:joined.index(None)]
    except ValueError:
        hit = joined
    decoded = {s: s.decode().split("\n") for s in set(hit)}  # type: ignore[union-attr]
    return list(map(list, map(decoded.__getitem__, hit)))  # type: ignore[arg-type]


def decode_holders(joined: Sequence[bytes | None]) -> list[list[str]]:
    """The holders of every key from one ``HMGET`` (an empty list for an unknown key)."""
    return [s.decode().split("\n") if s is not None else [] for s in joined]
