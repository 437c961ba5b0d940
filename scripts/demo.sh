#!/usr/bin/env bash
# The main job: the whole gpumedic pipeline on this machine, with no GPU and no cluster.
#
# Builds gpumedic, then runs `gpumedic demo`: it brings the testbed up (Kafka, PostgreSQL, etcd,
# kube-apiserver on 127.0.0.1), creates a simulated GPU fleet as real Nodes and Pods in the
# apiserver, starts the four services (one collector per node, with simulated GPUs), makes one
# GPU fall off the bus, and narrates what happens: detected, classified, cordoned, drained,
# recorded; not released by the other GPUs' heartbeats; recovered once a simulated reboot proves
# the repair. Then it prints the incident history from PostgreSQL and stops the services.
#
#   scripts/demo.sh          run the story and stop
#   scripts/demo.sh --keep   leave the services running afterwards (stop them with Ctrl-C)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

command -v cargo >/dev/null || {
  echo "Rust is required: install it with rustup (https://rustup.rs), then run this again." >&2
  exit 1
}
# The testbed first: on a fresh machine it installs what the build needs too (cmake, protoc).
# Quiet here: `gpumedic demo` runs it again (a no-op by then) and shows its state or its errors.
echo "==> Preparing the testbed (the first run downloads and builds it)"
./compose/up >/dev/null 2>&1 || true
echo "==> Building gpumedic"
cargo build --workspace --bins --quiet
exec target/debug/gpumedic demo "$@"
