#!/usr/bin/env bash
# Builds the router guest in JavaScript into router_js.wasm (a WebAssembly component, ~12 MB: the
# SpiderMonkey engine is inside) with one command. foldhost's JS SDK (foldhost/sdk/js) does the
# work: rolldown bundles router.js with the SDK (`import ... from 'foldhost-guest'`) into one
# module, and componentize-js makes it a component of foldhost's WIT world `guest`. The tools are
# pinned in foldhost/sdk/js/package-lock.json; the first build installs them there (`npm ci`).
#
# The SDK and the WIT come from `foldhost/`, laid out as `foldhost new-guest` writes it beside a
# scaffold. When it is missing, this script provides it: inside a foldhost checkout as links to the
# checkout's sdk/ and wit/; anywhere else from the foldhost binary (FOLDHOST, else `foldhost` on
# PATH), which carries both.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

if ! command -v node >/dev/null 2>&1; then
    echo "build.sh: node not found: install Node.js 20 or later (with npm)" >&2
    exit 1
fi

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
        "$fh" new-guest carried --lang js --dir "$scratch/carried" >/dev/null
        mv "$scratch/carried/foldhost" foldhost
    fi
fi
# ----

sdk=foldhost/sdk/js
if [[ ! -d "$sdk/node_modules/@bytecodealliance/componentize-js" ]]; then
    echo "build.sh: installing the JavaScript toolchain into $sdk (npm ci, once)" >&2
    (cd "$sdk" && npm ci --no-audit --no-fund --loglevel=error >&2)
fi
node "$sdk/build.mjs" router.js router_js.wasm foldhost/wit
echo "built router_js.wasm"
