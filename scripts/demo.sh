#!/usr/bin/env bash
# The main job: the whole gpumedic pipeline on this machine, with no GPU and no cluster.
#
# Brings the testbed up (Kafka, PostgreSQL, etcd, kube-apiserver on 127.0.0.1), builds gpumedic,
# creates a simulated GPU fleet as real Nodes and Pods in the apiserver, starts the four services
# (one collector per node, with simulated GPUs), injects Xid 79 on one GPU, and narrates what
# happens: detected, classified, cordoned, drained, recorded, recovered. Then it prints the
# incident history from PostgreSQL and stops the services.
#
#   scripts/demo.sh          run the story and stop
#   scripts/demo.sh --keep   leave the services running afterwards (stop them with Ctrl-C)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

keep=0
[ "${1:-}" = "--keep" ] && keep=1
command -v cargo >/dev/null || {
  echo "Rust is required: install it with rustup (https://rustup.rs), then run this again." >&2
  exit 1
}

say() { printf '\n==> %s\n' "$*"; }
tell() { printf '    %s\n' "$*"; }
fail() {
  printf '\ndemo failed: %s\n' "$*" >&2
  for s in "${!pid[@]}"; do
    printf -- '--- last lines of %s ---\n' "$s" >&2
    tail -n 8 "$logs/$s.log" >&2 || true
  done
  exit 1
}
# waitfor SECONDS DESCRIPTION COMMAND...: until COMMAND succeeds.
waitfor() {
  local secs="$1" what="$2"; shift 2
  local i
  for ((i = 0; i < secs * 4; i++)); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.25
  done
  fail "timed out after ${secs}s waiting for: $what"
}

say "Starting the testbed (Kafka, PostgreSQL, etcd and kube-apiserver on 127.0.0.1)"
./compose/up 2>&1 >/dev/null | sed 's/^/    /'
eval "$(./compose/env)"

say "Building gpumedic"
cargo build --workspace --bins --quiet
bin=target/debug
logs=.testbed/logs/demo
mkdir -p "$logs"
sql() { PGPASSWORD=gpumedic psql "$DATABASE_URL" -X -q -t -A -c "$1" 2>/dev/null; }

run_id="$(date +%H%M%S)"
ns="demo-$run_id"
nodes=()
for i in 0 1 2 3; do nodes+=("demo-$run_id-gpu-$i"); done
faulty="${nodes[2]}"

say "Creating a simulated fleet: ${#nodes[@]} GPU nodes (8 simulated H100s each) and their training pods"
for n in "${nodes[@]}"; do
  kubectl apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Node
metadata:
  name: $n
  labels:
    nvidia.com/gpu.present: "true"
    nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3
    node.kubernetes.io/instance-type: p5.48xlarge
    topology.kubernetes.io/zone: demo-zone-a
    gpumedic.io/demo: "$run_id"
EOF
done
kubectl create namespace "$ns" >/dev/null
for n in "${nodes[@]}"; do
  for j in 0 1; do
    kubectl apply -n "$ns" -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: trainer-${n##*-}-$j
spec:
  nodeName: $n
  containers:
  - name: train
    image: nvcr.io/nvidia/pytorch:25.01-py3
    resources:
      limits:
        nvidia.com/gpu: "4"
EOF
  done
done
tell "nodes: ${nodes[*]}"
tell "pods: $(kubectl get pods -n "$ns" --no-headers | wc -l) training pods in namespace $ns"

# The default rules, with quiet periods cut to seconds so recovery happens while you watch, and
# synthetic (injected) events allowed: a production classifier ignores them.
rules=".testbed/demo-rules"
rm -rf "$rules" && mkdir -p "$rules"
for f in services/classifier/rules/*.yaml; do
  sed -e 's/quiet: 15m/quiet: 20s/' "$f" >"$rules/$(basename "$f")"
done

export GPUMEDIC_KAFKA_BOOTSTRAP="$KAFKA_BOOTSTRAP" GPUMEDIC_SHUTDOWN_DEADLINE=10s KUBECONFIG
# Each run uses new consumer groups; starting them at the end of the topics keeps this run's story
# from queueing behind every record earlier runs and tests left (production groups start at the
# beginning, so nothing is missed after a first deployment).
fresh_groups="auto.offset.reset=latest"
"$bin/gpumedic" topics create --kafka-bootstrap "$KAFKA_BOOTSTRAP" >/dev/null

declare -A pid=()
start() {
  local name="$1" port="$2"; shift 2
  env GPUMEDIC_ADMIN_ADDR="127.0.0.1:$port" "$@" >"$logs/$name.log" 2>&1 &
  pid[$name]=$!
}
stop_all() {
  for s in "${!pid[@]}"; do kill -TERM "${pid[$s]}" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap stop_all EXIT

say "Starting the four services"
port=9410
for n in "${nodes[@]}"; do
  start "collector-${n##*-}" "$port" GPUMEDIC_NODE_NAME="$n" GPUMEDIC_GPU_BACKEND=simulated \
    GPUMEDIC_SAMPLE_INTERVAL=1s GPUMEDIC_HEARTBEAT_INTERVAL=2s GPUMEDIC_KMSG_PATH=off "$bin/gpumedic-collector"
  port=$((port + 1))
done
start enricher 9402 GPUMEDIC_KAFKA_OPTIONS="$fresh_groups" GPUMEDIC_GROUP="demo-$run_id-enricher" GPUMEDIC_CLUSTER_NAME=demo "$bin/gpumedic-enricher"
start classifier 9403 GPUMEDIC_KAFKA_OPTIONS="$fresh_groups" GPUMEDIC_GROUP="demo-$run_id-classifier" GPUMEDIC_DATABASE_URL="$DATABASE_URL" \
  GPUMEDIC_RULES_DIR="$rules" GPUMEDIC_ALLOW_SYNTHETIC=true GPUMEDIC_TICK=500ms "$bin/gpumedic-classifier"
start remediator 9404 GPUMEDIC_KAFKA_OPTIONS="$fresh_groups" GPUMEDIC_GROUP="demo-$run_id-remediator" GPUMEDIC_MODE=cordon-drain \
  GPUMEDIC_GPU_NODE_SELECTOR="gpumedic.io/demo=$run_id" GPUMEDIC_BREAKER_MAX_SHARE=0.5 \
  GPUMEDIC_DRAIN_GRACE_SECONDS=0 GPUMEDIC_DRAIN_DEADLINE=60s "$bin/gpumedic-remediator"
tell "collectors on 9410-9413, enricher 9402, classifier 9403, remediator 9404 (/healthz /readyz /metrics)"
ready() { curl -fsS "http://127.0.0.1:$1/readyz"; }
for p in 9410 9411 9412 9413 9402 9403 9404; do waitfor 120 "the service on port $p to be ready" ready "$p"; done
tell "all services report ready; each simulated GPU sends a heartbeat every 2 s"

say "Injecting a fault: Xid 79 (GPU has fallen off the bus) on $faulty, GPU 3"
event_id="$("$bin/gpumedic" inject --kafka-bootstrap "$KAFKA_BOOTSTRAP" --node "$faulty" --xid 79 --gpu-index 3)"
tell "published raw event $event_id on gpumedic.health.raw.v1 (marked synthetic)"

has_event() { [ "$(sql "SELECT count(*) FROM health_events WHERE event_id = '$event_id'")" = 1 ]; }
waitfor 60 "the event to be enriched, classified and recorded" has_event
tell "detected: the enricher added the node's context and the Xid catalog entry; the classifier recorded the event"

has_verdict() { [ -n "$(sql "SELECT 1 FROM verdicts WHERE node = '$faulty' AND NOT recovery LIMIT 1")" ]; }
waitfor 60 "a verdict" has_verdict
tell "classified: $(sql "SELECT severity || ', recommended action ' || action || ' (rule ' || rule_id || ')' FROM verdicts WHERE node = '$faulty' AND NOT recovery ORDER BY issued_at LIMIT 1")"

cordoned() { [ "$(kubectl get node "$faulty" -o jsonpath='{.spec.unschedulable}')" = true ]; }
waitfor 60 "$faulty to be cordoned" cordoned
tell "cordoned: $faulty is unschedulable; taint $(kubectl get node "$faulty" -o jsonpath='{range .spec.taints[?(@.key=="gpumedic.io/unhealthy")]}{.key}={.value}:{.effect}{end}')"
tell "condition: GpuUnhealthy=$(kubectl get node "$faulty" -o jsonpath='{.status.conditions[?(@.type=="GpuUnhealthy")].status}') reason $(kubectl get node "$faulty" -o jsonpath='{.status.conditions[?(@.type=="GpuUnhealthy")].reason}')"

drained() { [ "$(kubectl get pods -n "$ns" --field-selector "spec.nodeName=$faulty" --no-headers 2>/dev/null | wc -l)" = 0 ]; }
waitfor 60 "the pods on $faulty to be evicted" drained
tell "drained: the training pods on $faulty were evicted through the Eviction API; $(kubectl get pods -n "$ns" --no-headers | wc -l) pods remain on the healthy nodes"

has_action() { [ -n "$(sql "SELECT 1 FROM actions a JOIN verdicts v USING (verdict_id) WHERE v.node = '$faulty' AND a.status = 'applied' LIMIT 1")" ]; }
waitfor 60 "the remediator's action to be recorded" has_action
tell "recorded: the incident, its verdict and the remediator's action are in PostgreSQL"

say "Recovery: the GPU answers again, and its heartbeats are healthy evidence held for the quiet period (20 s here)"
uncordoned() {
  [ "$(kubectl get node "$faulty" -o jsonpath='{.spec.unschedulable}')" != true ] &&
    [ "$(kubectl get node "$faulty" -o jsonpath='{.status.conditions[?(@.type=="GpuUnhealthy")].status}')" = False ]
}
waitfor 90 "$faulty to be returned to service" uncordoned
tell "recovered: $faulty is schedulable again, gpumedic's taint is gone, GpuUnhealthy=False"
resolved() { [ -n "$(sql "SELECT 1 FROM incidents WHERE node = '$faulty' AND resolved_at IS NOT NULL LIMIT 1")" ]; }
waitfor 30 "the incident to be resolved" resolved

say "Incident history for this run (PostgreSQL)"
PGPASSWORD=gpumedic psql "$DATABASE_URL" -X -q -c "
  SELECT i.node, i.rule_id AS rule, i.severity,
         to_char(i.opened_at, 'HH24:MI:SS') AS opened,
         to_char(i.resolved_at, 'HH24:MI:SS') AS resolved,
         round(extract(epoch FROM i.resolved_at - i.opened_at)::numeric, 1) AS seconds_out,
         (SELECT string_agg(DISTINCT a.action || ':' || a.status, ', ')
            FROM actions a JOIN verdicts v USING (verdict_id) WHERE v.incident_id = i.incident_id) AS actions
    FROM incidents i WHERE i.node LIKE 'demo-$run_id-%' ORDER BY i.opened_at;" | sed 's/^/    /'

if [ "$keep" -eq 1 ]; then
  say "The services keep running (logs in $logs); press Ctrl-C to stop them"
  trap - EXIT
  wait
  exit 0
fi

say "Stopping the services"
trap - EXIT
for s in "${!pid[@]}"; do kill -TERM "${pid[$s]}"; done
rc=0
for s in "${!pid[@]}"; do
  st=0
  wait "${pid[$s]}" || st=$?
  if [ "$st" -ne 0 ]; then
    echo "    $s exited with status $st" >&2
    rc=1
  fi
done
[ "$rc" -eq 0 ] && say "Done: a GPU fault was detected, classified, quarantined, drained, recorded and recovered, end to end."
exit $rc
