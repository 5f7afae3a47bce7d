#!/usr/bin/env bash
# System packages the integration tests need: redis-server (private index per test), iproute2
# (network namespaces for the multi-host tests) and openssh-server (`ray up` over SSH into those
# namespaces), curl (the README's HTTP example). Idempotent and quiet: installs only what is
# missing, prints one line if it does.
set -euo pipefail

need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
[ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v ssh >/dev/null 2>&1 || need+=(openssh-client)
command -v rsync >/dev/null 2>&1 || need+=(rsync)  # `ray up` file_mounts use rsync
command -v curl >/dev/null 2>&1 || need+=(curl)  # the README's `kvstore serve` example

if [ "${#need[@]}" -eq 0 ]; then
  exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  sudo="sudo"
fi
echo "install-system-deps: installing ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
# The package lists may be stale or absent in a fresh container; refresh only on a failed install.
if ! $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null 2>&1; then
  $sudo apt-get update -qq >/dev/null
  $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
# The package's postinst may start a system sshd on :22 in the root namespace; the tests run
# their own sshd per namespace, so a system one is not needed (and may not exist in containers).
