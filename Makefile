# The two commands of the README. Each does its own set-up on a fresh machine.
#   make demo   — a local nats-server, a bucket, a fold, a resume: end to end
#   make test   — formatting, lints, and every test suite against a real nats-server
.PHONY: demo test setup bench

SETUP = NATS_SERVER_BIN="$$(scripts/setup.sh)"

demo:
	$(SETUP) && export NATS_SERVER_BIN && cargo run --quiet -p foldhost -- demo

test:
	$(SETUP) && export NATS_SERVER_BIN && \
	cargo fmt --all -- --check && \
	cargo clippy --workspace --all-targets --quiet -- -D warnings && \
	cargo build --workspace --bins --quiet && \
	if cargo nextest --version >/dev/null 2>&1; then \
	  cargo nextest run --workspace --no-fail-fast; \
	else \
	  cargo test --workspace --no-fail-fast; \
	fi

setup:
	scripts/setup.sh >/dev/null

bench:
	$(SETUP) && export NATS_SERVER_BIN && \
	cargo run --release --quiet -p foldhost-tests --bin foldhost-bench
