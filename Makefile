# The two commands of the README. Each does its own set-up on a fresh machine.
#   make demo   — a local nats-server, a bucket of routes, the router guest, a fold, queries
#   make test   — formatting, lints, and every test suite against a real nats-server
# and, beside them:
#   make flake  — the whole suite RUNS times (default 5) with one core held busy; names every failure
#   make fuzz   — every fuzz target FUZZ_SECS seconds (default 300) on nightly (docs/fuzzing.md)
.PHONY: demo test install setup guests bench slipfold bench-bootstrap lint lint-sources flake fuzz

# `test` and `lint` cover the optional storage backends too (RocksDB is a long C++ build; see
# docs in crates/foldhost-core/src/snapshot/rocks.rs) and compile in the crash points the crash tests arm
# (crates/foldhost-core/src/crashpoint.rs; never in `demo`, `bench` or a release build). `demo` stays on the
# default build.
FEATURES = --features fjall,rocksdb,crashpoints
RUNS ?= 5
BENCH_RUNS ?= 3

# Each target installs only what it needs (scripts/setup.sh says what each tier holds): `demo` the
# nats-server and the wasm32-wasip2 target, `bench` every guest toolchain too, `test` Chromium too.
SETUP = NATS_SERVER_BIN="$$(scripts/setup.sh)" && export NATS_SERVER_BIN
SETUP_TEST = NATS_SERVER_BIN="$$(scripts/setup.sh --test)" && export NATS_SERVER_BIN
SETUP_BENCH = NATS_SERVER_BIN="$$(scripts/setup.sh --bench)" && export NATS_SERVER_BIN

demo:
	$(SETUP) && guests/build.sh router >/dev/null && cargo run --quiet -p foldhost -- demo

# `test` compiles the workspace once, through clippy's driver: clippy's lints (`-D warnings`) run
# in the very build the suites use, where a separate `cargo clippy` pass would check every
# dependency (wasmtime, RocksDB, …) a second time. It covers what `cargo clippy --workspace
# --all-targets` does: every library with and without its tests, every binary, every suite.
# `make lint` keeps the separate pass, for a developer's quick look without a build.
CLIPPY_BUILD = RUSTC_WORKSPACE_WRAPPER="$$(command -v clippy-driver)" CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings"

test:
	$(SETUP_TEST) && guests/build.sh && guests/router-c/build.sh test && \
	guests/router-js/build.sh test && guests/router-py/build.sh test && \
	cargo test --quiet --manifest-path sdk/rust/Cargo.toml --features json && \
	cargo test --quiet --manifest-path sdk/rust/Cargo.toml --features json,state && \
	$(MAKE) --no-print-directory lint-sources && \
	{ command -v clippy-driver >/dev/null || { echo "make test: no clippy-driver (rustup component add clippy)" >&2; exit 1; }; } && \
	$(CLIPPY_BUILD) cargo build --workspace --bins --quiet $(FEATURES) && \
	if cargo nextest --version >/dev/null 2>&1; then \
	  $(CLIPPY_BUILD) cargo nextest run --workspace --no-fail-fast $(FEATURES); \
	else \
	  $(CLIPPY_BUILD) cargo test --workspace --no-fail-fast $(FEATURES); \
	fi && \
	scripts/install-check.sh

lint: lint-sources
	cargo clippy --workspace --all-targets --quiet $(FEATURES) -- -D warnings

# Everything `lint` checks but the workspace's clippy pass (which `test` runs inside its build).
lint-sources:
	python3 scripts/test_lint_layers.py
	python3 scripts/lint-layers.py
	python3 scripts/lint-citations.py
	cargo fmt --all -- --check
	cargo fmt --manifest-path guests/Cargo.toml --all -- --check
	cargo fmt --manifest-path sdk/rust/Cargo.toml -- --check
	cargo fmt --manifest-path bench/slipfold/Cargo.toml -- --check
	cargo clippy --manifest-path sdk/rust/Cargo.toml --all-targets --features json --quiet -- -D warnings
	cargo clippy --manifest-path sdk/rust/Cargo.toml --all-targets --features json,state --quiet -- -D warnings
	cargo clippy --manifest-path guests/Cargo.toml --target wasm32-wasip2 --quiet -- -D warnings

# The release binary with every backend (`full`), into PREFIX/bin (default /usr/local/bin); the
# same as `cargo install --locked --path host --features full --root PREFIX`.
PREFIX ?= /usr/local
install:
	cargo install --locked --path host --features full --root $(PREFIX)

setup:
	scripts/setup.sh --test >/dev/null

flake:
	scripts/flake.sh $(RUNS)

guests:
	guests/build.sh

# Coverage-guided fuzzing of every parser of untrusted bytes (docs/fuzzing.md): each target in
# fuzz/fuzz_targets/ for FUZZ_SECS seconds (FUZZ_TARGETS="a b" for some), one at a time, on the
# nightly toolchain and cargo-fuzz (installed when missing), into fuzz/target. `make test` replays
# every corpus on stable without this.
FUZZ_SECS ?= 300
fuzz:
	FUZZ_SECS=$(FUZZ_SECS) fuzz/run.sh

# Every benchmark, one table (figure, baseline from the same run, ratio, target; the cores and the
# date): ~25 minutes on 2 cores. Builds the release binaries, the guests and the slipstream
# baseline tool (bench/slipfold, into target/slipfold) first. BENCH_RUNS=3 by default.
bench: slipfold
	$(SETUP_BENCH) && guests/build.sh >/dev/null && \
	cargo build --release --quiet -p foldhost --features fjall,rocksdb && \
	cargo run --release --quiet -p foldhost-tests --features fjall,rocksdb --bin foldhost-bench -- table $(BENCH_RUNS)

# beyond-slipstream 0.8.6 folding a bucket with a native closure: the library a user would pick
# instead, as a measuring tool (never a dependency of the project).
slipfold:
	cargo build --release --locked --quiet --manifest-path bench/slipfold/Cargo.toml --target-dir target/slipfold

# Artifact bootstrap vs full replay, 1 000 000 keys on fjall and RocksDB (the release binary).
bench-bootstrap:
	$(SETUP_BENCH) && cargo build --release --quiet -p foldhost --features fjall,rocksdb && \
	cargo run --release --quiet -p foldhost-tests --features fjall,rocksdb --bin foldhost-bench -- bootstrap $(KEYS)
