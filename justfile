# gpumedic's everyday tasks. `just` lists them. The README's two commands (scripts/demo.sh and
# scripts/test.sh) work without just; these recipes call the same scripts.

cargo := "cargo"

# List the recipes.
default:
    @just --list

# The main job: the pipeline against the testbed (pass --keep to leave it running).
demo *args:
    ./scripts/demo.sh {{args}}

# Every test, against the real servers (starts the testbed first).
test *args:
    ./scripts/test.sh {{args}}

# The tests that need no server (unit tests of every crate), in a minute or two.
unit:
    {{cargo}} test --workspace --all-features --lib --bins

# What CI runs: the tests, clippy with warnings denied, and the format check.
ci:
    ./.ci/run

# Clippy over every target, warnings denied.
lint:
    {{cargo}} clippy --workspace --all-targets --all-features -- -D warnings

# Format the code.
fmt:
    {{cargo}} fmt --all

# The load scenarios that fit in about 10 minutes, release builds, against the testbed; results
# in target/load-tests/*.json, figures in docs/benchmarks.md, plots redrawn into docs/img/.
bench:
    ./compose/up >/dev/null
    {{cargo}} build --release -p gpumedic -p gpumedic-enricher -p gpumedic-classifier -p gpumedic-remediator -p gpumedic-console -p gpumedic-load-tests
    eval "$(./compose/env)" && target/release/gpumedic-load-tests kafka-ceiling --records 200000
    eval "$(./compose/env)" && target/release/gpumedic-load-tests classify-throughput
    eval "$(./compose/env)" && target/release/gpumedic-load-tests pipeline-throughput
    eval "$(./compose/env)" && target/release/gpumedic-load-tests latency
    eval "$(./compose/env)" && target/release/gpumedic-load-tests backtest
    eval "$(./compose/env)" && target/release/gpumedic-load-tests remediation
    eval "$(./compose/env)" && target/release/gpumedic-load-tests console
    load-tests/plot/run

# The soak, on request: the pipeline for 30 minutes at 5,000 events/s from the simulated fleet,
# RSS and consumer lag of each service sampled (pass e.g. --duration 5m to shorten it).
soak *args:
    ./compose/up >/dev/null
    {{cargo}} build --release -p gpumedic-enricher -p gpumedic-classifier -p gpumedic-remediator -p gpumedic-load-tests
    eval "$(./compose/env)" && target/release/gpumedic-load-tests soak {{args}}
    load-tests/plot/run

# The chaos suite (about 10 minutes): the pipeline at 2,000 events/s on private servers of its own
# (never the shared testbed) while every service is SIGKILLed and Kafka, PostgreSQL and the
# apiserver are restarted or paused; proves by id that nothing was lost or doubled and every node
# ends as its incidents call for. Exits 1 when a proof fails. Result in target/load-tests/chaos.json.
chaos *args:
    {{cargo}} build --release -p gpumedic-collector -p gpumedic-enricher -p gpumedic-classifier -p gpumedic-remediator -p gpumedic-load-tests
    target/release/gpumedic-load-tests chaos {{args}}

# The chaos suite's short variant (about 5 minutes when the pipeline settles): one of each fault.
chaos-short *args:
    just chaos --short {{args}}

# Start the testbed (Kafka, PostgreSQL, schema registry, Jaeger, etcd, kube-apiserver) and print
# its addresses.
testbed-up *servers:
    ./compose/up {{servers}}

# Stop the testbed (--wipe also deletes its data).
testbed-down *args:
    ./compose/down {{args}}

# Show which testbed servers are up.
testbed-status:
    ./compose/status
