#!/usr/bin/env bash
# `make fuzz`: every fuzz target (or those named in FUZZ_TARGETS) for FUZZ_SECS seconds each (300
# by default), one after the other, one job each, over its corpus in fuzz/corpus/<target>/. What a
# run finds is written to fuzz/artifacts/<target>/ (ignored by git: keep a finding as a regression
# under fuzz/regressions/<target>/, docs/fuzzing.md). Installs the nightly toolchain and cargo-fuzz
# (pinned) when they are missing. Builds into fuzz/target, never the main target/.
set -euo pipefail
cd "$(dirname "$0")/.."

FUZZ_SECS="${FUZZ_SECS:-300}"
CARGO_FUZZ_VERSION=0.13.2
ALL_TARGETS="nats_wire stored_record append_log artifact channel_records ledger_row"
TARGETS="${FUZZ_TARGETS:-$ALL_TARGETS}"

if ! rustup run nightly rustc --version >/dev/null 2>&1; then
  echo "fuzz: installing the nightly toolchain" >&2
  rustup toolchain install nightly --profile minimal >&2
fi
if ! cargo fuzz --version 2>/dev/null | grep -q "$CARGO_FUZZ_VERSION"; then
  echo "fuzz: installing cargo-fuzz $CARGO_FUZZ_VERSION" >&2
  cargo install --locked cargo-fuzz --version "$CARGO_FUZZ_VERSION" >&2
fi

for t in $TARGETS; do
  mkdir -p "fuzz/corpus/$t"
  echo "fuzz: $t for ${FUZZ_SECS} s" >&2
  cargo +nightly fuzz run "$t" "fuzz/corpus/$t" -- -max_total_time="$FUZZ_SECS"
done
