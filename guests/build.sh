#!/usr/bin/env bash
# Builds every guest in this workspace as a WebAssembly component (wasm32-wasip2, release), then the
# C, JavaScript and Python guests (router-c/, router-js/, router-py/build.sh), and lists them:
# target/wasm32-wasip2/release/<name_with_underscores>.wasm. Honours CARGO_BUILD_JOBS.
#
#   guests/build.sh          every guest (the tests' and the benchmarks' set)
#   guests/build.sh router   the Rust router only (`make demo`: no other language's toolchain needed)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"

target=wasm32-wasip2
if ! rustup target list --installed 2>/dev/null | grep -qx "$target"; then
    echo "build.sh: the $target target is missing: rustup target add $target" >&2
    exit 1
fi

jobs=()
if [[ -n "${CARGO_BUILD_JOBS:-}" ]]; then
    jobs=(-j "$CARGO_BUILD_JOBS")
fi

if [[ "${1:-}" == "router" ]]; then
    cargo build --release --target "$target" "${jobs[@]}" -p router
    echo "$here/target/$target/release/router.wasm"
    exit 0
fi

cargo build --release --target "$target" "${jobs[@]}"
# Guests in other languages build themselves into the same directory, and so do the hand-written
# hostile components (core WAT made components with wasm-tools).
router-c/build.sh
router-js/build.sh
router-py/build.sh
hostile-wat/build.sh

out="$here/target/$target/release"
# Every workspace member (a directory with a Cargo.toml) is a cdylib guest.
crates=()
for manifest in */Cargo.toml; do
    name="$(sed -n 's/^name *= *"\(.*\)"/\1/p' "$manifest" | head -n 1)"
    crates+=("${name//-/_}")
done
if [[ ${#crates[@]} -eq 0 ]]; then
    echo "build.sh: no guest crates found" >&2
    exit 1
fi
crates+=(router_c)                    # built by router-c/build.sh above
crates+=(router_js router_py)         # built by router-js/build.sh and router-py/build.sh above
crates+=(table_bomb four_memories)    # built by hostile-wat/build.sh above

status=0
for crate in "${crates[@]}"; do
    wasm="$out/$crate.wasm"
    if [[ ! -f "$wasm" ]]; then
        echo "build.sh: missing $wasm" >&2
        status=1
        continue
    fi
    # A component starts with \0asm and layer 0x0d 0x00 0x01 0x00 (a core module has 01 00 00 00).
    magic="$(head -c 8 "$wasm" | od -An -tx1 | tr -d ' \n')"
    if [[ "$magic" != "0061736d0d000100" ]]; then
        echo "build.sh: $wasm is not a component (header $magic)" >&2
        status=1
        continue
    fi
    printf '%9d  %s\n' "$(stat -c %s "$wasm")" "${wasm#"$here"/}"
done
exit "$status"
