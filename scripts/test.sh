#!/usr/bin/env bash
# Runs every gpumedic test against real servers. On a fresh machine it first installs what is
# missing and starts the testbed (Kafka, PostgreSQL, etcd, kube-apiserver on 127.0.0.1), then
# builds the workspace and runs all unit, integration and doc tests. Extra arguments go to
# `cargo test` (for example a test name filter).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

command -v cargo >/dev/null || {
  echo "Rust is required: install it with rustup (https://rustup.rs), then run this again." >&2
  exit 1
}

GPUMEDIC_PROMTOOL_LATER=1 ./compose/up >/dev/null
eval "$(./compose/env)"
export KAFKA_BOOTSTRAP DATABASE_URL KUBECONFIG SCHEMA_REGISTRY_URL OTLP_ENDPOINT JAEGER_QUERY_URL
# promtool (for the alert tests) is a Go build of tens of minutes on a fresh machine: build it
# beside the cargo build rather than before it. Nothing to do once it is in the cache.
./compose/lib/install-promtool.sh &
promtool_build=$!
# Headless Chromium (Debian's package) for the console's browser tests; nothing to do once installed.
./compose/lib/install-chromium.sh >/dev/null

# End-to-end tests start every service binary, so build them all first: every target with the
# features the tests use, so `cargo test` reuses this build instead of building the dependencies
# a second time with another feature set (on 2 cold cores that second build costs ~20 minutes).
cargo build --workspace --all-targets --all-features
wait "$promtool_build" || { echo "the promtool build failed (see ~/.cache/gpumedic/promtool-build.log)" >&2; exit 1; }
# The whole output is kept, and on a failure every failing test's message is printed again at the
# end, where a CI log's tail shows it (the failures sections are scattered through the run).
log="${CARGO_TARGET_DIR:-target}/test-run.log"
mkdir -p "$(dirname "$log")"
status=0
cargo test --workspace --all-features --no-fail-fast "$@" 2>&1 | tee "$log" || status=$?
if [ "$status" -ne 0 ]; then
  echo
  echo "==== the failing tests' messages again (the whole run: $log) ===="
  awk '/^failures:$/ { inside = 1 } inside { print } /^test result: FAILED/ { inside = 0 }' "$log"
  grep -E "^error: [0-9]+ targets? failed|^    \`-p " "$log" || true
fi
exit "$status"
