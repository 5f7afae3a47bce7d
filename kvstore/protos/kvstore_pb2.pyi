from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NamespaceSpec(_message.Message):
    __slots__ = ("schema_version", "model_fingerprint", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "cache_salt", "numerics")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    model_fingerprint: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    cache_salt: str
    numerics: str
    def __init__(self, schema_version: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., cache_salt: _Optional[str] = ..., numerics: _Optional[str] = ...) -> None: ...

class PutChunk(_message.Message):
    __slots__ = ("namespace", "key", "total_nbytes", "offset", "data", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NBYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: NamespaceSpec
    key: bytes
    total_nbytes: int
    offset: int
    data: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[_Union[NamespaceSpec, _Mapping]] = ..., key: _Optional[bytes] = ..., total_nbytes: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PutBatchRequest(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[PutChunk]
    def __init__(self, chunks: _Optional[_Iterable[_Union[PutChunk, _Mapping]]] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("num_stored", "num_existing")
    NUM_STORED_FIELD_NUMBER: _ClassVar[int]
    NUM_EXISTING_FIELD_NUMBER: _ClassVar[int]
    num_stored: int
    num_existing: int
    def __init__(self, num_stored: _Optional[int] = ..., num_existing: _Optional[int] = ...) -> None: ...

class KeysRequest(_message.Message):
    __slots__ = ("keys", "reader_node_id", "namespace")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    READER_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    reader_node_id: str
    namespace: NamespaceSpec
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., reader_node_id: _Optional[str] = ..., namespace: _Optional[_Union[NamespaceSpec, _Mapping]] = ...) -> None: ...

class GetChunk(_message.Message):
    __slots__ = ("key", "found", "total_nbytes", "offset", "data")
    KEY_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NBYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    found: bool
    total_nbytes: int
    offset: int
    data: bytes
    def __init__(self, key: _Optional[bytes] = ..., found: _Optional[bool] = ..., total_nbytes: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("keys", "ttl_s", "reader_node_id", "release_lease_ids", "namespace", "accept_files", "packed")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    READER_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RELEASE_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_FILES_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    ttl_s: float
    reader_node_id: str
    release_lease_ids: _containers.RepeatedScalarFieldContainer[str]
    namespace: NamespaceSpec
    accept_files: bool
    packed: bool
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., ttl_s: _Optional[float] = ..., reader_node_id: _Optional[str] = ..., release_lease_ids: _Optional[_Iterable[str]] = ..., namespace: _Optional[_Union[NamespaceSpec, _Mapping]] = ..., accept_files: _Optional[bool] = ..., packed: _Optional[bool] = ...) -> None: ...

class BlockLocation(_message.Message):
    __slots__ = ("key", "offset", "nbytes", "file")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    offset: int
    nbytes: int
    file: str
    def __init__(self, key: _Optional[bytes] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., file: _Optional[str] = ...) -> None: ...

class LeaseResponse(_message.Message):
    __slots__ = ("lease_id", "locations", "missing", "expires_at", "shm_path", "held_keys", "offsets", "sizes")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    HELD_KEYS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    locations: _containers.RepeatedCompositeFieldContainer[BlockLocation]
    missing: _containers.RepeatedScalarFieldContainer[bytes]
    expires_at: float
    shm_path: str
    held_keys: bytes
    offsets: _containers.RepeatedScalarFieldContainer[int]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_id: _Optional[str] = ..., locations: _Optional[_Iterable[_Union[BlockLocation, _Mapping]]] = ..., missing: _Optional[_Iterable[bytes]] = ..., expires_at: _Optional[float] = ..., shm_path: _Optional[str] = ..., held_keys: _Optional[bytes] = ..., offsets: _Optional[_Iterable[int]] = ..., sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "ttl_s")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    ttl_s: float
    def __init__(self, lease_id: _Optional[str] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class RenewLeaseResponse(_message.Message):
    __slots__ = ("expires_at",)
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    expires_at: float
    def __init__(self, expires_at: _Optional[float] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExistsResponse(_message.Message):
    __slots__ = ("present", "nbytes")
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    present: _containers.RepeatedScalarFieldContainer[bool]
    nbytes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, present: _Optional[_Iterable[bool]] = ..., nbytes: _Optional[_Iterable[int]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("num_deleted",)
    NUM_DELETED_FIELD_NUMBER: _ClassVar[int]
    num_deleted: int
    def __init__(self, num_deleted: _Optional[int] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("bytes_freed",)
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    bytes_freed: int
    def __init__(self, bytes_freed: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("node_id", "capacity_bytes", "used_bytes", "num_blocks", "num_leased", "num_pinned")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASED_FIELD_NUMBER: _ClassVar[int]
    NUM_PINNED_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    capacity_bytes: int
    used_bytes: int
    num_blocks: int
    num_leased: int
    num_pinned: int
    def __init__(self, node_id: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_leased: _Optional[int] = ..., num_pinned: _Optional[int] = ...) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("node_id", "serving", "grpc_address", "bulk_address", "shm_path")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BULK_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    serving: bool
    grpc_address: str
    bulk_address: str
    shm_path: str
    def __init__(self, node_id: _Optional[str] = ..., serving: _Optional[bool] = ..., grpc_address: _Optional[str] = ..., bulk_address: _Optional[str] = ..., shm_path: _Optional[str] = ...) -> None: ...

class ListKeysRequest(_message.Message):
    __slots__ = ("page_size",)
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    def __init__(self, page_size: _Optional[int] = ...) -> None: ...

class KeyInfo(_message.Message):
    __slots__ = ("key", "nbytes", "parent_key", "namespace_root")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ROOT_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    nbytes: int
    parent_key: bytes
    namespace_root: bytes
    def __init__(self, key: _Optional[bytes] = ..., nbytes: _Optional[int] = ..., parent_key: _Optional[bytes] = ..., namespace_root: _Optional[bytes] = ...) -> None: ...

class KeyPage(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[KeyInfo]
    def __init__(self, keys: _Optional[_Iterable[_Union[KeyInfo, _Mapping]]] = ...) -> None: ...

class ReaderReport(_message.Message):
    __slots__ = ("hits", "misses", "rejected", "fetched_blocks", "fetched_bytes", "fetch_seconds", "prefill_tokens")
    class MissesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RejectedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class FetchedBlocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class FetchedBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class PrefillTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    FETCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FETCHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FETCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    hits: int
    misses: _containers.ScalarMap[str, int]
    rejected: _containers.ScalarMap[str, int]
    fetched_blocks: _containers.ScalarMap[str, int]
    fetched_bytes: _containers.ScalarMap[str, int]
    fetch_seconds: _containers.RepeatedCompositeFieldContainer[FetchTimes]
    prefill_tokens: _containers.ScalarMap[str, int]
    def __init__(self, hits: _Optional[int] = ..., misses: _Optional[_Mapping[str, int]] = ..., rejected: _Optional[_Mapping[str, int]] = ..., fetched_blocks: _Optional[_Mapping[str, int]] = ..., fetched_bytes: _Optional[_Mapping[str, int]] = ..., fetch_seconds: _Optional[_Iterable[_Union[FetchTimes, _Mapping]]] = ..., prefill_tokens: _Optional[_Mapping[str, int]] = ...) -> None: ...

class FetchTimes(_message.Message):
    __slots__ = ("path", "seconds")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    path: str
    seconds: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, path: _Optional[str] = ..., seconds: _Optional[_Iterable[float]] = ...) -> None: ...

class JoinedKeys(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: bytes
    def __init__(self, keys: _Optional[bytes] = ...) -> None: ...

class HolderSet(_message.Message):
    __slots__ = ("node_ids",)
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class HoldersReply(_message.Message):
    __slots__ = ("num_keys", "sets", "set_of_key")
    NUM_KEYS_FIELD_NUMBER: _ClassVar[int]
    SETS_FIELD_NUMBER: _ClassVar[int]
    SET_OF_KEY_FIELD_NUMBER: _ClassVar[int]
    num_keys: int
    sets: _containers.RepeatedCompositeFieldContainer[HolderSet]
    set_of_key: bytes
    def __init__(self, num_keys: _Optional[int] = ..., sets: _Optional[_Iterable[_Union[HolderSet, _Mapping]]] = ..., set_of_key: _Optional[bytes] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("node_id", "keys", "parent_keys", "nbytes", "roots", "root_of_entry")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEYS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    ROOTS_FIELD_NUMBER: _ClassVar[int]
    ROOT_OF_ENTRY_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    keys: bytes
    parent_keys: bytes
    nbytes: bytes
    roots: _containers.RepeatedScalarFieldContainer[bytes]
    root_of_entry: bytes
    def __init__(self, node_id: _Optional[str] = ..., keys: _Optional[bytes] = ..., parent_keys: _Optional[bytes] = ..., nbytes: _Optional[bytes] = ..., roots: _Optional[_Iterable[bytes]] = ..., root_of_entry: _Optional[bytes] = ...) -> None: ...
