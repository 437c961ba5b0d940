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

# What CI runs: the tests, clippy with warnings denied, and the format check.
ci:
    ./.ci/run

# Clippy over every target, warnings denied.
lint:
    {{cargo}} clippy --workspace --all-targets -- -D warnings

# Format the code.
fmt:
    {{cargo}} fmt --all

# Start the testbed (Kafka, PostgreSQL, etcd, kube-apiserver) and print its addresses.
testbed-up *servers:
    ./compose/up {{servers}}

# Stop the testbed (--wipe also deletes its data).
testbed-down *args:
    ./compose/down {{args}}

# Show which testbed servers are up.
testbed-status:
    ./compose/status
