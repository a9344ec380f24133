#!/usr/bin/env bash
# The flake check: the whole test suite (the same `nextest run` as `make test`, every backend, the
# crash points compiled in) RUNS times in a row, default 5, with one core kept busy by a spinning
# process the whole time. Every failure is reported with its test name and run number; the exit
# status is non-zero when any run had one. Each run's full output is kept in $FLAKE_DIR
# (default target/flake/).
#
#   scripts/flake.sh [RUNS]        or        make flake RUNS=5
set -euo pipefail
cd "$(dirname "$0")/.."

runs="${1:-5}"
features=(--features fjall,rocksdb,crashpoints)
out="${FLAKE_DIR:-target/flake}"
mkdir -p "$out"

NATS_SERVER_BIN="$(scripts/setup.sh --test)"
export NATS_SERVER_BIN
guests/build.sh >/dev/null
guests/router-c/build.sh test >/dev/null
# Build once, before the load starts: the runs measure the tests, not the compiler.
cargo build -p foldhost --bin foldhost --quiet "${features[@]}"
if cargo nextest --version >/dev/null 2>&1; then
  runner=(cargo nextest run --workspace --no-fail-fast --final-status-level fail "${features[@]}")
  cargo nextest run --workspace --no-run "${features[@]}"
  # nextest's status lines: `FAIL [ 1.2s] crate::binary module::test` (and SIGABRT, TIMEOUT…).
  failed_lines() { grep -E '^\s*(FAIL|SIG[A-Z]+|TIMEOUT|ABORT|LEAK-FAIL) \[' "$1" | sed -E 's/^\s*//' | sort -u; }
else
  runner=(cargo test --workspace --no-fail-fast "${features[@]}")
  cargo test --workspace --no-run --quiet "${features[@]}"
  failed_lines() { grep -E '^test .* \.\.\. FAILED$' "$1" | sort -u; }
fi

# One core busy for the whole check: a shell spinning in place.
bash -c 'while :; do :; done' &
spinner=$!
trap 'kill "$spinner" 2>/dev/null || true' EXIT
echo "flake: $runs runs of: ${runner[*]}  (one core held busy by pid $spinner)"

total=0
for i in $(seq 1 "$runs"); do
  log="$out/run-$i.log"
  start=$(date +%s)
  status=0
  "${runner[@]}" >"$log" 2>&1 || status=$?
  secs=$(( $(date +%s) - start ))
  summary=$(grep -E '^\s*Summary \[|^test result:' "$log" | tail -n 1 | sed -E 's/^\s*//')
  fails=$(failed_lines "$log" || true)
  n=0
  [ -n "$fails" ] && n=$(printf '%s\n' "$fails" | wc -l)
  if [ "$status" -ne 0 ] && [ "$n" -eq 0 ]; then
    fails="(exit $status with no failed test named: see $log)"
    n=1
  fi
  total=$(( total + n ))
  echo "flake: run $i/$runs: ${summary:-no summary} — $n failure(s), ${secs}s, log $log"
  if [ "$n" -gt 0 ]; then
    printf '%s\n' "$fails" | sed "s/^/flake:   run $i: /"
  fi
done
echo "flake: $total failure(s) in $runs runs under load"
[ "$total" -eq 0 ]
