#!/usr/bin/env bash
# Builds the router guest in Rust into router_rust.wasm (a WebAssembly component) with one command:
# `cargo build --release --target wasm32-wasip2`, then a copy of the component here.
#
# The SDK and the WIT come from `foldhost/`, laid out as `foldhost new-guest` writes it beside a
# scaffold. When it is missing, this script provides it: inside a foldhost checkout as links to the
# checkout's sdk/ and wit/; anywhere else from the foldhost binary (FOLDHOST, else `foldhost` on
# PATH), which carries both.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

# ---- foldhost/: the SDK and the WIT (the same block in every examples/router-*/build.sh) ----
if [[ ! -f foldhost/wit/guest.wit ]]; then
    rm -rf foldhost # links copied out of a checkout, which no longer resolve
    if [[ -f ../../sdk/README.md && -f ../../wit/guest.wit ]]; then
        mkdir foldhost
        ln -s ../../../sdk foldhost/sdk
        ln -s ../../../wit foldhost/wit
    else
        fh="${FOLDHOST:-foldhost}"
        if ! command -v "$fh" >/dev/null 2>&1; then
            echo "build.sh: no foldhost/ here and no foldhost binary to write it: install foldhost" \
                "(cargo install --locked --path host, in a checkout) or set FOLDHOST" >&2
            exit 1
        fi
        scratch="$(mktemp -d)"
        trap 'rm -rf "$scratch"' EXIT
        "$fh" new-guest carried --lang rust --dir "$scratch/carried" >/dev/null
        mv "$scratch/carried/foldhost" foldhost
    fi
fi
# ----

if command -v rustup >/dev/null 2>&1 && ! rustup target list --installed | grep -qx wasm32-wasip2; then
    rustup target add wasm32-wasip2 >&2
fi
cargo build --release --target wasm32-wasip2 --quiet
cp "${CARGO_TARGET_DIR:-target}/wasm32-wasip2/release/router_rust.wasm" router_rust.wasm
echo "built router_rust.wasm"
