#!/usr/bin/env bash
# Builds the router guest in C into router_c.wasm (a WebAssembly component) with one command:
#   wit-bindgen c             foldhost/wit -> bindings/ (guest.h, guest.c, the component type)
#   clang (wasm32-wasi)       router.c, exports.c and the bindings -> a core module, against
#                             wasi-libc but without its start files (only malloc and mem* are
#                             used, and those need no WASI import)
#   wasm-tools                the core module -> the component
# then refuses a component that imports anything but the WIT's own interfaces.
# Tools: clang (or WASI_CC) with wasm-ld and a wasi-libc sysroot (Debian's clang finds
# /usr/lib/wasm32-wasi itself; WASI_SYSROOT names another), wit-bindgen and wasm-tools, on PATH.
#
# The WIT comes from `foldhost/`, laid out as `foldhost new-guest` writes it beside a scaffold.
# When it is missing, this script provides it: inside a foldhost checkout as links to the
# checkout's sdk/ and wit/; anywhere else from the foldhost binary (FOLDHOST, else `foldhost` on
# PATH), which carries it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

for tool in "${WASI_CC:-clang}" wit-bindgen wasm-tools; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "build.sh: $tool not found (README.md says what to install)" >&2
        exit 1
    fi
done

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
        "$fh" new-guest carried --lang c --dir "$scratch/carried" >/dev/null
        mv "$scratch/carried/foldhost" foldhost
    fi
fi
# ----

sysroot=()
if [[ -n "${WASI_SYSROOT:-}" ]]; then
    sysroot=(--sysroot "$WASI_SYSROOT")
fi
rm -rf bindings && mkdir bindings
# Quiet unless it fails: it reports every file it writes.
if ! log="$(wit-bindgen c foldhost/wit --world guest --out-dir bindings 2>&1)"; then
    echo "$log" >&2
    exit 1
fi
"${WASI_CC:-clang}" --target=wasm32-wasi "${sysroot[@]}" -std=c11 -Wall -Wextra -Werror -O2 \
    -I bindings -nostartfiles -Wl,--no-entry -Wl,--strip-all -o bindings/router_c.core.wasm \
    router.c exports.c bindings/guest.c bindings/guest_component_type.o
wasm-tools component new bindings/router_c.core.wasm -o bindings/router_c.wasm

# The guest may import the WIT's own interfaces (types, which holds only types, and fold and log
# when it calls them) and nothing else: no WASI, hence no stdio and no adapter.
imports="$(wasm-tools component wit bindings/router_c.wasm | sed -n 's/^ *import \([^;]*\);.*/\1/p')"
allowed=$'foldhost:guest/types@0.1.0\nfoldhost:guest/fold@0.1.0\nfoldhost:guest/log@0.1.0'
while IFS= read -r import; do
    if [[ -n "$import" ]] && ! grep -qxF "$import" <<<"$allowed"; then
        echo "build.sh: the component imports $import (only foldhost:guest/types, fold and log" \
            "are allowed)" >&2
        exit 1
    fi
done <<<"$imports"
mv bindings/router_c.wasm router_c.wasm
echo "built router_c.wasm"
