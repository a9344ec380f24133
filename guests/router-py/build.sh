#!/usr/bin/env bash
# Builds router-py, the router guest written in Python, as a WebAssembly component beside the Rust
# guests: ../target/wasm32-wasip2/release/router_py.wasm, where guests/build.sh lists it.
# componentize-py (PyPI, pinned in scripts/setup.sh) generates the WIT bindings (wit_world) inside
# the build, snapshots CPython with router.py and the SDK (sdk/python/foldhost_guest.py) imported,
# and makes the component (~18 MB: the interpreter and the standard library are inside).
#
#   build.sh        build (prints nothing on success; guests/build.sh prints the listing)
#   build.sh test   the SDK's and the router's unit tests, natively, with fake host imports
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
guests="$(dirname "$here")"
root="$(dirname "$guests")"
sdk="$root/sdk/python"
out="$guests/target/wasm32-wasip2/release/router_py.wasm"

if [[ "${1:-}" == "test" ]]; then
    # No bytecode caches in the source tree.
    export PYTHONDONTWRITEBYTECODE=1
    python3 -m unittest discover -s "$sdk" -p 'test_*.py' -q
    exec python3 -m unittest discover -s "$here" -t "$here" -p 'test_*.py' -q
fi

if ! command -v componentize-py >/dev/null 2>&1; then
    echo "router-py/build.sh: componentize-py not found: run scripts/setup.sh" >&2
    exit 1
fi
mkdir -p "$(dirname "$out")"
# Quiet unless it fails: it reports success on stdout. (Its CPython, 3.14, leaves __pycache__/ in
# the -p directories: git ignores them.)
if ! log="$(componentize-py -d "$root/wit" -w guest componentize \
    -p "$sdk" -p "$here" router -o "$out.tmp" 2>&1)"; then
    echo "$log" >&2
    rm -f "$out.tmp"
    exit 1
fi
mv "$out.tmp" "$out"
