#!/usr/bin/env bash
# The main job: brings the testbed up, builds gpumedic, starts its four services against the real
# servers, waits until each reports ready on /readyz, shows what they serve, then stops them with
# SIGTERM and checks each exits cleanly within its shutdown deadline.
#
#   scripts/demo.sh          run and stop
#   scripts/demo.sh --keep   leave the services running (stop them with Ctrl-C)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

keep=0
[ "${1:-}" = "--keep" ] && keep=1

command -v cargo >/dev/null || {
  echo "Rust is required: install it with rustup (https://rustup.rs), then run this again." >&2
  exit 1
}

say() { printf '\n==> %s\n' "$*"; }

say "Starting the testbed (Kafka, PostgreSQL, etcd, kube-apiserver on 127.0.0.1)"
./compose/up >/dev/null
eval "$(./compose/env)"
./compose/status

say "Building gpumedic"
cargo build --workspace --bins --quiet
bin=target/debug
logs=.testbed/logs
mkdir -p "$logs"

export GPUMEDIC_KAFKA_BOOTSTRAP="$KAFKA_BOOTSTRAP"
export GPUMEDIC_DATABASE_URL="$DATABASE_URL"
export KUBECONFIG
export GPUMEDIC_SHUTDOWN_DEADLINE=10s

"$bin/gpumedic" topics create --kafka-bootstrap "$KAFKA_BOOTSTRAP" >/dev/null

declare -A port=([collector]=9401 [enricher]=9402 [classifier]=9403 [remediator]=9404)
declare -A pid=()
stop_all() {
  for s in "${!pid[@]}"; do kill -TERM "${pid[$s]}" 2>/dev/null || true; done
}
trap stop_all EXIT

say "Starting the four services"
for s in collector enricher classifier remediator; do
  GPUMEDIC_ADMIN_ADDR="127.0.0.1:${port[$s]}" GPUMEDIC_NODE_NAME=demo-gpu-node-0 \
    "$bin/gpumedic-$s" >"$logs/$s.log" 2>&1 &
  pid[$s]=$!
  echo "gpumedic-$s: pid ${pid[$s]}, admin http://127.0.0.1:${port[$s]}, log $logs/$s.log"
done

say "Waiting for each service to report ready on /readyz"
for s in collector enricher classifier remediator; do
  ready=0
  for _ in $(seq 1 120); do
    if curl -fsS "http://127.0.0.1:${port[$s]}/readyz" >/dev/null 2>&1; then ready=1; break; fi
    kill -0 "${pid[$s]}" 2>/dev/null || break
    sleep 0.5
  done
  if [ "$ready" -ne 1 ]; then
    echo "gpumedic-$s did not become ready: $(curl -sS "http://127.0.0.1:${port[$s]}/readyz" 2>&1 || true)" >&2
    tail -n 20 "$logs/$s.log" >&2
    exit 1
  fi
  echo "gpumedic-$s: $(curl -sS "http://127.0.0.1:${port[$s]}/readyz")"
done

say "The pipeline's topics in Kafka"
kcat -b "$KAFKA_BOOTSTRAP" -L 2>/dev/null | grep -o 'topic "gpumedic[^"]*"' | sort

if [ "$keep" -eq 1 ]; then
  say "Services are running; press Ctrl-C to stop them"
  wait
  exit 0
fi

say "Stopping the services with SIGTERM"
trap - EXIT
for s in collector enricher classifier remediator; do kill -TERM "${pid[$s]}"; done
rc=0
for s in collector enricher classifier remediator; do
  st=0
  wait "${pid[$s]}" || st=$?
  if [ "$st" -eq 0 ]; then
    echo "gpumedic-$s: stopped cleanly"
  else
    echo "gpumedic-$s: exited with status $st" >&2
    rc=1
  fi
done
[ "$rc" -eq 0 ] && say "Done: all four services started against the testbed, reported ready and stopped cleanly."
exit $rc
