#!/usr/bin/env bash
# The path a new user takes, checked end to end (`make test` runs it last):
#
#   1. install the binary from the checkout with the documented command, `cargo install --locked
#      --path host --features full` — here with `--debug` into a scratch prefix, sharing the test
#      build's target directory (the same command minus the optimised build, which CI cannot afford);
#      the test build's `target/debug/foldhost` (crash points compiled in) is put back afterwards and
#      checked unchanged, so the tree stays fit for the next test run;
#   2. `foldhost --version`;
#   3. the quick start against a local nats-server: `run --create-bucket` with the router guest,
#      a route written through the node (`foldhost put`), the route asked back (`POST /query`);
#   4. a guest in Rust and one in Python, scaffolded by the installed binary in a directory outside
#      the checkout, built with their own one command, folded and queried.
#
# Needs NATS_SERVER_BIN (scripts/setup.sh prints it), the guests built (guests/build.sh) and the
# toolchains `scripts/setup.sh --test` installs. Every wait is on a condition, bounded.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
nats_bin="${NATS_SERVER_BIN:-nats-server}"
tmp="$(mktemp -d)"
pids=()
# The nodes first (newest first), each waited for, then the nats-server: a node stops cleanly (its
# consumer deleted) only while its server is there.
cleanup() {
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    kill "${pids[i]}" 2>/dev/null || true
    wait "${pids[i]}" 2>/dev/null || true
  done
  rm -rf "$tmp"
}
trap cleanup EXIT

say() { echo "install-check: $*" >&2; }
fail() { say "FAILED: $*"; for f in "$tmp"/*.log; do [ -f "$f" ] && { echo "--- $f" >&2; tail -n 20 "$f" >&2; }; done; exit 1; }

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# Waits (at most 60 s) until `$@` succeeds.
until_ok() {
  for _ in $(seq 1 600); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.1
  done
  return 1
}

# POST /query on ADDR with BODY; prints the answer's body.
query() {
  python3 - "$1" "$2" <<'EOF'
import sys, urllib.request
req = urllib.request.Request(f"http://{sys.argv[1]}/query", data=sys.argv[2].encode())
print(urllib.request.urlopen(req, timeout=10).read().decode())
EOF
}

# The install shares the test build's target directory: a directory of its own would build
# wasmtime and RocksDB a second time (minutes on two cores, on every `make test`). Sharing has one
# cost, handled here: the install relinks `target/debug/foldhost` to its own build (without crash
# points), and cargo does not link the test build back while that build is fresh, so the next
# crash test would find "this build has no crash points". The test build's binary is kept aside
# (a hard link, in the same directory tree) and put back, on failure too.
test_bin="$root/target/debug/foldhost"
kept="$root/target/debug/.foldhost.install-check"
restore_test_bin() {
  if [ -e "$kept" ]; then mv -f "$kept" "$test_bin"; fi
}
if [ -e "$test_bin" ]; then
  ln -f "$test_bin" "$kept" 2>/dev/null || cp -p "$test_bin" "$kept"
  test_sum="$(cksum <"$test_bin")"
fi
trap 'restore_test_bin; cleanup' EXIT

say "cargo install --locked --path host --features full (--debug, into a scratch prefix)"
cargo install --locked --debug --quiet --path "$root/host" --features full \
  --root "$tmp/prefix" --target-dir "$root/target"
restore_test_bin
if [ -n "${test_sum:-}" ]; then
  [ "$(cksum <"$test_bin")" = "$test_sum" ] \
    || fail "the install left $test_bin other than the test build it was"
fi
fh="$tmp/prefix/bin/foldhost"
version="$("$fh" --version)"
[[ "$version" == foldhost\ * ]] || fail "foldhost --version said: $version"
say "$version"

nats_port="$(free_port)"
"$nats_bin" -js -a 127.0.0.1 -p "$nats_port" -sd "$tmp/nats" >"$tmp/nats.log" 2>&1 &
pids+=($!)
until_ok bash -c "exec 3<>/dev/tcp/127.0.0.1/$nats_port" || fail "nats-server did not listen"
nats="nats://127.0.0.1:$nats_port"

# Runs GUEST folding BUCKET (created when absent) with --listen on a free port; sets `addr` once
# the node is running. (Not called in a command substitution: the node's pid must reach `pids`, so
# that the cleanup stops it.)
start_node() { # name bucket guest
  addr="127.0.0.1:$(free_port)"
  "$fh" run --nats "$nats" --bucket "$2" --create-bucket --store "$tmp/$1.store" \
    --guest "$3" --listen "$addr" >"$tmp/$1.log" 2>&1 &
  pids+=($!)
  until_ok "$fh" status --listen "$addr" || fail "$1: the node did not start"
}

# Puts KEY=VALUE through the node at ADDR and waits for QUERY to answer WANT.
put_and_ask() { # addr key value query want
  "$fh" put --listen "$1" --wait-ms 10000 "$2" "$3" >"$tmp/put.out" \
    || fail "put $2 through $1: $(cat "$tmp/put.out")"
  local got
  got="$(query "$1" "$4")" || fail "query $4 on $1"
  [ "$got" = "$5" ] || fail "query $4 on $1 answered $got, not $5"
  say "$1: $4 -> $got"
}

say "quick start: the router guest on a bucket the node creates"
start_node router routes "$root/guests/target/wasm32-wasip2/release/router.wasm"
put_and_ask "$addr" route.example.com '{"upstream":"10.0.0.1:8080"}' example.com \
  '{"upstream":"10.0.0.1:8080"}'

say "a Rust guest scaffolded outside the checkout"
"$fh" new-guest greeter-rs --lang rust --dir "$tmp/greeter-rs" >/dev/null
(cd "$tmp/greeter-rs" && cargo build --release --target wasm32-wasip2 --quiet) \
  || fail "the Rust scaffold did not build"
start_node greeter-rs greetings-rs "$tmp/greeter-rs/target/wasm32-wasip2/release/greeter_rs.wasm"
put_and_ask "$addr" greeting.alice hello alice hello

say "a Python guest scaffolded outside the checkout"
"$fh" new-guest greeter-py --lang python --dir "$tmp/greeter-py" >/dev/null
"$tmp/greeter-py/build.sh" >/dev/null || fail "the Python scaffold did not build"
start_node greeter-py greetings-py "$tmp/greeter-py/greeter_py.wasm"
put_and_ask "$addr" greeting.bob hi bob hi

say "ok"
