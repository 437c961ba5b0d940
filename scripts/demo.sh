#!/usr/bin/env bash
# The main job: the whole gpumedic pipeline on this machine, with no GPU and no cluster.
#
# Brings the testbed up (Kafka, PostgreSQL, etcd, kube-apiserver on 127.0.0.1), builds gpumedic,
# then runs `gpumedic demo`: it creates a simulated GPU fleet as real Nodes and Pods in the
# apiserver, starts the four services (one collector per node, with simulated GPUs), makes one
# GPU fall off the bus, and narrates what happens: detected, classified, cordoned, drained,
# recorded; not released by the other GPUs' heartbeats; recovered once a simulated reboot proves
# the repair. Then it prints the incident history from PostgreSQL, stops the services and removes
# the Nodes, namespace and consumer groups it created.
#
# Each step is announced with the time since the start. The long ones (the testbed, which on the
# first run downloads and builds its servers, and the build) write their output to a log file
# whose path is printed; while they run, their latest line is shown every 15 seconds. A step that
# fails stops the script with the end of its log and its exit status.
#
#   scripts/demo.sh          run the story and stop
#   scripts/demo.sh --keep   leave the services running afterwards (stop them with Ctrl-C)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

START=$SECONDS
LOGS="$PWD/.testbed/logs/demo-sh"
mkdir -p "$LOGS"

elapsed() {
  local s=$((SECONDS - START))
  printf '%d:%02d' $((s / 60)) $((s % 60))
}

announce() {
  printf '\n==> [%s] %s\n' "$(elapsed)" "$*"
}

# step NAME LOG COMMAND...: runs COMMAND with its output in LOG, shows its latest line every 15 s,
# and on failure prints the end of LOG and exits with COMMAND's status.
step() {
  local name="$1" log="$2"
  shift 2
  announce "$name (log: $log)"
  "$@" >"$log" 2>&1 &
  local pid=$! last=$SECONDS rc=0
  trap 'kill "$pid" 2>/dev/null; exit 130' INT TERM
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    if ((SECONDS - last >= 15)); then
      last=$SECONDS
      printf '    [%s] %s\n' "$(elapsed)" "$(tail -n 1 "$log" | cut -c1-150)"
    fi
  done
  wait "$pid" || rc=$?
  trap - INT TERM
  if ((rc != 0)); then
    printf '\n%s failed (exit status %d) after %s. The end of %s:\n\n' "$name" "$rc" "$(elapsed)" "$log" >&2
    tail -n 40 "$log" >&2
    exit "$rc"
  fi
  printf '    [%s] done\n' "$(elapsed)"
}

command -v cargo >/dev/null || {
  echo "Rust is required: install it with rustup (https://rustup.rs), then run this again." >&2
  exit 1
}

# The testbed first: on a fresh machine it installs what the build needs too (cmake, protoc), and
# downloads and builds its servers (a kube-apiserver build among them): many minutes, once.
if ./compose/status >/dev/null 2>&1; then
  announce "The testbed is up already (compose/status)"
else
  step "Preparing the testbed: installing, downloading and building what is missing, then starting the servers" \
    "$LOGS/testbed.log" ./compose/up
fi

# The same features as scripts/test.sh, so the two share one build.
step "Building gpumedic (the first build takes several minutes)" "$LOGS/build.log" \
  cargo build --workspace --bins --all-features
announce "Running gpumedic demo (its services' logs: .testbed/logs/demo/<run id>/)"
exec "${CARGO_TARGET_DIR:-target}/debug/gpumedic" demo "$@"
