#!/usr/bin/env bash
# Builds the router guest in Python into router_py.wasm (a WebAssembly component, ~18 MB: CPython
# is inside) with one command: componentize-py generates the bindings of foldhost's WIT world
# `guest` inside the build, snapshots the interpreter with router.py and foldhost's Python SDK
# (foldhost/sdk/python) imported, and writes the component. componentize-py is pinned: the first
# build installs it from PyPI.
#
# The SDK and the WIT come from `foldhost/`, laid out as `foldhost new-guest` writes it beside a
# scaffold. When it is missing, this script provides it: inside a foldhost checkout as links to the
# checkout's sdk/ and wit/; anywhere else from the foldhost binary (FOLDHOST, else `foldhost` on
# PATH), which carries both.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
export PYTHONDONTWRITEBYTECODE=1
# The version scripts/setup.sh pins in a foldhost checkout.
componentize_py=0.25.1

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
        "$fh" new-guest carried --lang python --dir "$scratch/carried" >/dev/null
        mv "$scratch/carried/foldhost" foldhost
    fi
fi
# ----

if [[ "$(componentize-py --version 2>/dev/null | awk '{print $2}')" != "$componentize_py" ]]; then
    echo "build.sh: installing componentize-py==$componentize_py from PyPI (once)" >&2
    python3 -m pip install --quiet --disable-pip-version-check "componentize-py==$componentize_py" >&2 \
        || python3 -m pip install --quiet --user --disable-pip-version-check \
            "componentize-py==$componentize_py" >&2
    PATH="$(python3 -m site --user-base)/bin:$PATH"
    export PATH
fi
# Quiet unless it fails.
if ! log="$(componentize-py -d foldhost/wit -w guest componentize -p foldhost/sdk/python -p . \
    router -o router_py.wasm 2>&1)"; then
    echo "$log" >&2
    exit 1
fi
echo "built router_py.wasm"
