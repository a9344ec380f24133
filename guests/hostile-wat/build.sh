#!/usr/bin/env bash
# Builds the hand-written hostile guests: each `NAME.wat` here is a core module implementing the
# canonical ABI of the guest world by hand; `wasm-tools component embed` attaches the world from
# ../../wit and `wasm-tools component new` makes it a component, written to OUT/NAME.wasm
# (default: ../target/wasm32-wasip2/release, beside the other guests).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${1:-$here/../target/wasm32-wasip2/release}"
mkdir -p "$out"
if ! command -v wasm-tools >/dev/null 2>&1; then
    echo "hostile-wat/build.sh: wasm-tools is missing (scripts/setup.sh installs it)" >&2
    exit 1
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
for wat in "$here"/*.wat; do
    name="$(basename "$wat" .wat)"
    wasm-tools component embed "$here/../../wit" --world guest "$wat" -o "$work/$name.core.wasm"
    wasm-tools component new "$work/$name.core.wasm" -o "$out/$name.wasm"
done
