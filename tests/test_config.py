"""Config loading: defaults < YAML < KVSTORE_* environment < overrides, and clear errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvstore.config import (
    ClientConfig,
    CoordinatorConfig,
    KVStoreConfig,
    PoolConfig,
    WorkerConfig,
    parse_size,
)
from kvstore.config_loader import load_config
from kvstore.errors import ConfigError


def write_yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvstore.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "want"),
    [("4GiB", 4 * 2**30), ("512MiB", 512 * 2**20), ("1.5GiB", 3 * 2**29), ("64KiB", 65536),
     ("4GB", 4 * 10**9), ("4 gib", 4 * 2**30), ("1073741824", 2**30), ("10B", 10),
     (123, 123), ("2TiB", 2 * 2**40)],
)
def test_parse_size(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("text", ["lots", "4XB", "-1GiB", "GiB", "", "4 GiB extra"])
def test_parse_size_rejects_non_sizes(text):
    with pytest.raises(ConfigError, match="not a size"):
        parse_size(text)


def test_defaults_without_file_or_environment():
    cfg = load_config(env={})
    assert cfg == KVStoreConfig()
    assert cfg.pool.capacity_bytes == 1 << 30
    assert cfg.index.backend == "memory"


def test_precedence_defaults_yaml_env_overrides(tmp_path):
    path = write_yaml(tmp_path, """
pool:
  capacity_bytes: 2GiB
server:
  port: 7000
  max_workers: 4
client:
  timeout_s: 5
""")
    env = {"KVSTORE_SERVER_PORT": "7100", "KVSTORE_POOL_CAPACITY_BYTES": "3GiB",
           "UNRELATED": "x"}
    cfg = load_config(path, env=env, overrides={"server": {"max_workers": 2, "port": None}})
    assert cfg.pool.capacity_bytes == 3 * 2**30      # env beats YAML
    assert cfg.server.port == 7100                   # env beats YAML; a None override is unset
    assert cfg.server.max_workers == 2               # override beats YAML
    assert cfg.client.timeout_s == 5.0               # YAML beats default
    assert cfg.client.retries == ClientConfig().retries  # default stays


def test_environment_values_are_coerced(tmp_path):
    env = {
        "KVSTORE_SERVER_METRICS_PORT": "9100",
        "KVSTORE_SERVER_AUTH_TOKEN": "none",
        "KVSTORE_CLIENT_TIMEOUT_S": "2.5",
        "KVSTORE_CLIENT_MAX_MESSAGE_BYTES": "8MiB",
        "KVSTORE_COORDINATOR_HIGH_WATERMARK": "0.99",
        "KVSTORE_INDEX_BACKEND": "redis",
        "KVSTORE_INDEX_REDIS_URL": "redis://127.0.0.1:1/0",
    }
    cfg = load_config(env=env)
    assert cfg.server.metrics_port == 9100
    assert cfg.server.auth_token is None
    assert cfg.client.timeout_s == 2.5
    assert cfg.client.max_message_bytes == 8 * 2**20
    assert cfg.coordinator.high_watermark == 0.99
    assert cfg.index.redis_url == "redis://127.0.0.1:1/0"


def test_yaml_sizes_are_parsed(tmp_path):
    path = write_yaml(tmp_path, "server:\n  max_message_bytes: 16MiB\n")
    assert load_config(path, env={}).server.max_message_bytes == 16 * 2**20


@pytest.mark.parametrize(
    ("text", "names"),
    [("pool:\n  capacity: 4GiB\n", "capacity"),
     ("poool:\n  capacity_bytes: 4GiB\n", "poool"),
     ("server:\n  prot: 1\n", "prot")],
)
def test_unknown_keys_are_errors_that_name_them(tmp_path, text, names):
    with pytest.raises(ConfigError, match=names):
        load_config(write_yaml(tmp_path, text), env={})


@pytest.mark.parametrize(
    ("source", "setting"),
    [
        ({"KVSTORE_SERVER_PORT": "abc"}, "server.port"),
        ({"KVSTORE_SERVER_PORT": "70000"}, "server.port"),
        ({"KVSTORE_CLIENT_TIMEOUT_S": "soon"}, "client.timeout_s"),
        ({"KVSTORE_CLIENT_TIMEOUT_S": "0"}, "client.timeout_s"),
        ({"KVSTORE_POOL_CAPACITY_BYTES": "lots"}, "pool.capacity_bytes"),
        ({"KVSTORE_POOL_CAPACITY_BYTES": "0"}, "pool.capacity_bytes"),
        ({"KVSTORE_POOL_SHM_DIR": "/no/such/dir"}, "pool.shm_dir"),
        ({"KVSTORE_SERVER_MAX_MESSAGE_BYTES": "1KiB"}, "server.max_message_bytes"),
        ({"KVSTORE_SERVER_TLS_CERT_FILE": "/tmp/cert.pem"}, "server.tls_key_file"),
        ({"KVSTORE_INDEX_BACKEND": "etcd"}, "index.backend"),
        ({"KVSTORE_INDEX_BACKEND": "redis"}, "index.redis_url"),
        ({"KVSTORE_COORDINATOR_LOW_WATERMARK": "0.98"}, "low_watermark"),
        ({"KVSTORE_COORDINATOR_HEARTBEAT_INTERVAL_S": "20"}, "heartbeat_interval_s"),
        ({"KVSTORE_WORKER_PREFILL_CHUNK_TOKENS": "100"}, "worker.prefill_chunk_tokens"),
        ({"KVSTORE_WORKER_BLOCK_SIZE": "0"}, "worker.block_size"),
        ({"KVSTORE_WORKER_DTYPE": "float64"}, "worker.dtype"),
        ({"KVSTORE_POOL_DISK_CAPACITY_BYTES": "lots"}, "pool.disk_capacity_bytes"),
        ({"KVSTORE_POOL_DISK_CAPACITY_BYTES": "1GiB"}, "needs pool.disk_dir"),
        ({"KVSTORE_POOL_DISK_DIR": "/tmp/kvstore-tier"}, "needs pool.disk_capacity_bytes"),
        ({"KVSTORE_POOL_DISK_DIR": "/etc/hostname",
          "KVSTORE_POOL_DISK_CAPACITY_BYTES": "1GiB"}, "is not a directory"),
        ({"KVSTORE_POOL_DISK_DIR": "/tmp/kvstore-tier", "KVSTORE_POOL_DISK_CAPACITY_BYTES": "1GiB",
          "KVSTORE_POOL_DISK_QUEUE_BYTES": "0"}, "pool.disk_queue_bytes"),
        ({"KVSTORE_POOL_DISK_READ_PATH": "mmap"}, "pool.disk_read_path"),
    ],
)
def test_invalid_values_name_the_setting(source, setting):
    with pytest.raises(ConfigError, match=setting):
        load_config(env=source)


def test_invalid_yaml_value_names_the_setting(tmp_path):
    path = write_yaml(tmp_path, "server:\n  max_workers: [1, 2]\n")
    with pytest.raises(ConfigError, match="server.max_workers"):
        load_config(path, env={})


@pytest.mark.parametrize("text", ["- a\n- b\n", "pool: 5\n"])
def test_yaml_that_is_not_a_mapping_is_an_error(tmp_path, text):
    with pytest.raises(ConfigError, match="mapping"):
        load_config(write_yaml(tmp_path, text), env={})


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.yaml", env={})


def test_a_disk_tier_needs_a_directory_and_a_capacity(tmp_path):
    pool = load_config(env={"KVSTORE_POOL_DISK_DIR": str(tmp_path / "tier"),
                            "KVSTORE_POOL_DISK_CAPACITY_BYTES": "2GiB",
                            "KVSTORE_POOL_DISK_READ_PATH": "buffered"}).pool
    assert pool.disk_enabled and pool.disk_capacity_bytes == 2 << 30
    assert pool.disk_read_path == "buffered"
    assert not load_config(env={}).pool.disk_enabled  # off by default


def test_dataclasses_validate_when_built_directly():
    assert PoolConfig(capacity_bytes="1MiB").capacity_bytes == 2**20  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="watermark"):
        CoordinatorConfig(high_watermark=1.5)
    with pytest.raises(ConfigError, match="worker.num_threads"):
        WorkerConfig(num_threads=0)
    assert isinstance(ConfigError("x"), ValueError)  # callers may catch ValueError


@pytest.mark.parametrize(("text", "where"), [
    ("pool:\n  capacity_bytes: [1\n", ":3:1: YAML syntax error"),
    ("pool:\n  capacity_bytes: 1GiB\n bad indent: 2\n", ":3:2: YAML syntax error"),
])
def test_yaml_syntax_error_names_file_and_line(tmp_path, text, where):
    path = write_yaml(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert str(info.value).startswith(f"{path}{where}")


def test_bad_size_in_file_names_file_line_and_valid_units(tmp_path):
    path = write_yaml(tmp_path, "server:\n  port: 7000\npool:\n  capacity_bytes: 4XB\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    message = str(info.value)
    assert message.startswith(f"{path}:4: pool.capacity_bytes: '4XB' is not a size")
    for unit in ("KiB", "MiB", "GiB", "TiB", "KB", "GB"):
        assert unit in message


def test_bad_size_flag_lists_valid_units_not_int():
    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides={"pool": {"capacity_bytes": "4XB"}})
    assert "is not a valid int" not in str(info.value)
    assert str(info.value).startswith("pool.capacity_bytes: '4XB' is not a size")
    assert "GiB" in str(info.value)


def test_unknown_setting_and_failed_check_name_file_and_line(tmp_path):
    path = write_yaml(tmp_path, "worker:\n  block_size: 16\n  blok_size: 8\n")
    with pytest.raises(ConfigError, match=rf"^{path}:3: worker.blok_size: unknown setting"):
        load_config(path, env={})
    path = write_yaml(tmp_path, "coordinator:\n  node_timeout_s: 10\n  lease_ttl_s: 0\n")
    with pytest.raises(ConfigError, match=rf"^{path}:3: coordinator.lease_ttl_s must be > 0"):
        load_config(path, env={})


@pytest.mark.parametrize("dtype", ["int8", "uint8", "float64"])
def test_worker_dtype_accepts_only_what_the_model_loader_runs(dtype):
    """int8 and uint8 are namespace dtypes but not model dtypes: refused when settings load."""
    with pytest.raises(ConfigError, match=r"worker.dtype .* use auto or one of \['float32', "
                                          r"'float16', 'bfloat16'\]"):
        WorkerConfig(dtype=dtype)


def test_documented_worker_dtypes_are_the_accepted_ones():
    """docs/configuration.md lists exactly the dtypes validation accepts."""
    from kvstore.config import WORKER_DTYPES

    doc = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    row = next(line for line in doc.splitlines() if line.startswith("| `dtype` | `KVSTORE_WORKER"))
    accepted = row.split("|")[4].split("(")[0]  # before "(anything else ... is rejected)"
    assert sorted(re.findall(r"`(\w+)`", accepted)) == sorted(("auto", *WORKER_DTYPES))
    for dtype in WORKER_DTYPES:
        WorkerConfig(dtype=dtype)
