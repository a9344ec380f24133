#!/usr/bin/env bash
# Builds router-c, the router guest written in C, as a WebAssembly component beside the Rust
# guests: ../target/wasm32-wasip2/release/router_c.wasm, where guests/build.sh lists it and the
# tests look for it. Three tools, three steps:
#   wit-bindgen c             ../../wit -> guest.h, guest.c, guest_component_type.o, generated
#                             afresh into ../target/router-c/bindings/ (never checked in)
#   clang (wasm32-wasi)       router.c, exports.c and the bindings -> a core module, against
#                             wasi-libc but without its start files: only malloc and mem* are
#                             used, and those need no WASI import
#   wasm-tools component new  the core module -> the component
# then refuses a component that imports anything but the WIT's own interfaces.
#
#   build.sh        build (prints nothing on success; guests/build.sh prints the listing)
#   build.sh test   compile router.c natively with ${CC:-cc} and run test_native.c
#
# Tools: clang (or WASI_CC), wasm-ld, a wasi-libc sysroot (Debian's clang finds
# /usr/lib/wasm32-wasi itself; WASI_SYSROOT names another), wit-bindgen, wasm-tools.
# scripts/setup.sh installs them all.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
guests="$(dirname "$here")"
wit="$(dirname "$guests")/wit"
work="$guests/target/router-c"
out="$guests/target/wasm32-wasip2/release/router_c.wasm"
warnings=(-std=c11 -Wall -Wextra -Werror)

if [[ "${1:-}" == "test" ]]; then
    mkdir -p "$work"
    cc="${CC:-cc}"
    # Sanitizers catch out-of-bounds reads and undefined behaviour the assertions alone would miss;
    # a compiler without them still runs the tests.
    sanitize=(-fsanitize=address,undefined -fno-sanitize-recover=all)
    if ! "$cc" "${warnings[@]}" -O1 -g "${sanitize[@]}" -o "$work/test_native" \
        "$here/router.c" "$here/test_native.c" 2>/dev/null; then
        echo "router-c: $cc has no sanitizers here; testing without them" >&2
        "$cc" "${warnings[@]}" -O2 -o "$work/test_native" "$here/router.c" "$here/test_native.c"
    fi
    exec "$work/test_native"
fi

need() {
    if ! command -v "$1" >/dev/null 2>&1; then
        echo "router-c/build.sh: $1 not found: run scripts/setup.sh" >&2
        exit 1
    fi
}
cc="${WASI_CC:-clang}"
need "$cc"
need wit-bindgen
need wasm-tools
sysroot=()
if [[ -n "${WASI_SYSROOT:-}" ]]; then
    sysroot=(--sysroot "$WASI_SYSROOT")
fi

rm -rf "$work/bindings"
mkdir -p "$work/bindings" "$(dirname "$out")"
# Quiet unless it fails: it reports every file it writes.
if ! log="$(wit-bindgen c "$wit" --world guest --out-dir "$work/bindings" 2>&1)"; then
    echo "$log" >&2
    exit 1
fi

# No start files and no entry point: the module is a library of exports (a "reactor" with nothing
# to initialise, since no code here has constructors), so it needs neither _start nor _initialize.
"$cc" --target=wasm32-wasi "${sysroot[@]}" "${warnings[@]}" -O2 \
    -I "$work/bindings" -nostartfiles -Wl,--no-entry -Wl,--strip-all \
    -o "$work/router_c.core.wasm" \
    "$here/router.c" "$here/exports.c" "$work/bindings/guest.c" \
    "$work/bindings/guest_component_type.o"

wasm-tools component new "$work/router_c.core.wasm" -o "$work/router_c.wasm"

# The guest may import the WIT's own interfaces (types, which holds only types, and fold and log
# when it calls them) and nothing else: no WASI, hence no stdio and no adapter to build with.
# Anything more fails the build.
imports="$(wasm-tools component wit "$work/router_c.wasm" |
    sed -n 's/^ *import \([^;]*\);.*/\1/p')"
allowed=$'foldhost:guest/types@0.1.0\nfoldhost:guest/fold@0.1.0\nfoldhost:guest/log@0.1.0'
while IFS= read -r import; do
    if [[ -n "$import" ]] && ! grep -qxF "$import" <<<"$allowed"; then
        echo "router-c/build.sh: the component imports $import" \
            "(only foldhost:guest/types, fold and log are allowed)" >&2
        exit 1
    fi
done <<<"$imports"

mv "$work/router_c.wasm" "$out"
