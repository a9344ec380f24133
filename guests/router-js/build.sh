#!/usr/bin/env bash
# Builds router-js, the router guest written in JavaScript, as a WebAssembly component beside the
# Rust guests: ../target/wasm32-wasip2/release/router_js.wasm, where guests/build.sh lists it.
# sdk/js/build.mjs does the work: rolldown bundles router.js with the JS SDK into one module, and
# componentize-js (pinned in sdk/js/package-lock.json, installed by scripts/setup.sh with `npm ci`)
# makes it a component (~12 MB: the SpiderMonkey engine is inside).
#
#   build.sh        build (prints nothing on success; guests/build.sh prints the listing)
#   build.sh test   the SDK's (both contracts': sdk/js/test/sdk.test.mjs, state.test.mjs) and the
#                   router's unit tests, under node with fake host imports
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
guests="$(dirname "$here")"
sdk="$(dirname "$guests")/sdk/js"
out="$guests/target/wasm32-wasip2/release/router_js.wasm"

if ! command -v node >/dev/null 2>&1; then
    echo "router-js/build.sh: node not found: install Node.js 20 or later (with npm), then run scripts/setup.sh" >&2
    exit 1
fi

if [[ "${1:-}" == "test" ]]; then
    exec node --import "$sdk/test/fake-host.mjs" --test --test-reporter=spec "$sdk/test/sdk.test.mjs" "$sdk/test/state.test.mjs" "$here/router.test.mjs"
fi

if [[ ! -d "$sdk/node_modules/@bytecodealliance/componentize-js" ]]; then
    echo "router-js/build.sh: the JS toolchain is not installed in $sdk: run scripts/setup.sh" >&2
    exit 1
fi
node "$sdk/build.mjs" "$here/router.js" "$out"
