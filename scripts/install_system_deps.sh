#!/usr/bin/env bash
# Install the system packages the test suite needs (a real redis-server for tests/serving).
# Idempotent: does nothing when redis-server is already on PATH. Runs unattended as root on Debian (CI),
# or through sudo when run as another user that has it.
set -euo pipefail

if command -v redis-server >/dev/null 2>&1; then
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_system_deps.sh: redis-server is missing and apt-get is not available;" \
       "install redis-server with your package manager" >&2
  exit 1
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null 2>&1; then
    echo "install_system_deps.sh: need root (or sudo) to apt-get install redis-server" >&2
    exit 1
  fi
  sudo="sudo"
fi

$sudo env DEBIAN_FRONTEND=noninteractive apt-get update -q
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends redis-server
# The Debian package starts a system-wide service on port 6379 where an init system runs; tests start their own
# server on a free port, so that service is not needed (and is absent in containers without an init system).
command -v redis-server >/dev/null
