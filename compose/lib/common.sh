# shellcheck shell=bash
# Shared settings for the testbed scripts: pinned versions, ports, folders and small helpers.
# Sourced by compose/up, down, status, env and the install steps; never run on its own.

set -euo pipefail

COMPOSE_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REPO_ROOT="$(cd "$COMPOSE_DIR/.." && pwd)"

# Pinned versions. The apiserver must stay inside the range k8s-openapi supports (see Cargo.toml).
KAFKA_VERSION="${KAFKA_VERSION:-4.1.1}"
KUBERNETES_VERSION="${KUBERNETES_VERSION:-v1.36.3}"
# Apicurio Registry: the newest release whose dependencies all resolve from Maven Central (see
# docs/testbed.md).
REGISTRY_VERSION="${REGISTRY_VERSION:-2.4.2.Final}"
# Jaeger v2: the OTLP receiver the tracing test reads traces back from.
JAEGER_VERSION="${JAEGER_VERSION:-v1.76.0}"
# Prometheus's promtool, for the alert rule tests. The Go module version v0.316.0 is Prometheus
# 3.16.0 (Prometheus tags its Go module v0.<minor>.<patch>).
PROMETHEUS_VERSION="${PROMETHEUS_VERSION:-v0.316.0}"

# Ports on 127.0.0.1, chosen away from the defaults so a system PostgreSQL on 5432 or a developer's
# own Kafka on 9092 never clash with the testbed.
KAFKA_PORT="${GPUMEDIC_KAFKA_PORT:-19092}"
KAFKA_CONTROLLER_PORT="${GPUMEDIC_KAFKA_CONTROLLER_PORT:-19093}"
POSTGRES_PORT="${GPUMEDIC_POSTGRES_PORT:-15432}"
ETCD_PORT="${GPUMEDIC_ETCD_PORT:-12379}"
ETCD_PEER_PORT="${GPUMEDIC_ETCD_PEER_PORT:-12380}"
APISERVER_PORT="${GPUMEDIC_APISERVER_PORT:-16443}"
SCHEMA_REGISTRY_PORT="${GPUMEDIC_SCHEMA_REGISTRY_PORT:-18081}"
OTLP_GRPC_PORT="${GPUMEDIC_OTLP_GRPC_PORT:-14317}"
OTLP_HTTP_PORT="${GPUMEDIC_OTLP_HTTP_PORT:-14318}"
JAEGER_QUERY_PORT="${GPUMEDIC_JAEGER_QUERY_PORT:-16686}"
JAEGER_QUERY_GRPC_PORT="${GPUMEDIC_JAEGER_QUERY_GRPC_PORT:-16685}"

# Downloads and builds are cached outside the checkout, so a fresh clone (as CI makes) reuses them.
CACHE_DIR="${GPUMEDIC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpumedic}"
BIN_DIR="$CACHE_DIR/bin"
# Runtime state (data, logs, pids, certificates) belongs to this checkout and is git-ignored.
STATE_DIR="${GPUMEDIC_TESTBED:-$REPO_ROOT/.testbed}"
LOG_DIR="$STATE_DIR/logs"
RUN_DIR="$STATE_DIR/run"

POSTGRES_USER=gpumedic
POSTGRES_PASSWORD=gpumedic
POSTGRES_DB=gpumedic

log() { printf '[testbed] %s\n' "$*" >&2; }
die() { printf '[testbed] error: %s\n' "$*" >&2; exit 1; }

# Root or passwordless sudo is needed only to install Debian packages.
as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo -n "$@"; fi
}

# pid_alive NAME: true when the process recorded in run/NAME.pid is running.
pid_alive() {
  local f="$RUN_DIR/$1.pid"
  [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null
}

# port_open PORT: true when something accepts TCP connections on 127.0.0.1:PORT.
port_open() {
  (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# wait_for DESCRIPTION SECONDS COMMAND...: retry COMMAND once a second until it succeeds.
wait_for() {
  local what="$1" secs="$2"; shift 2
  local i
  for ((i = 0; i < secs; i++)); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 1
  done
  return 1
}

# start_daemon NAME LOGFILE COMMAND...: run COMMAND detached, record its pid.
start_daemon() {
  local name="$1" logfile="$2"; shift 2
  mkdir -p "$RUN_DIR" "$LOG_DIR"
  setsid "$@" >>"$logfile" 2>&1 < /dev/null &
  echo $! >"$RUN_DIR/$name.pid"
}

# stop_daemon NAME: SIGTERM, then SIGKILL after 20 s.
stop_daemon() {
  local name="$1" f="$RUN_DIR/$1.pid" pid i
  [ -f "$f" ] || return 0
  pid="$(cat "$f")"
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 40; i++)); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.5
    done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}

KUBECONFIG_PATH="$STATE_DIR/kubeconfig"
KAFKA_BOOTSTRAP="127.0.0.1:$KAFKA_PORT"
SCHEMA_REGISTRY_URL="http://127.0.0.1:$SCHEMA_REGISTRY_PORT/apis/ccompat/v7"
OTLP_ENDPOINT="http://127.0.0.1:$OTLP_GRPC_PORT"
JAEGER_QUERY_URL="http://127.0.0.1:$JAEGER_QUERY_PORT"
DATABASE_URL="postgres://$POSTGRES_USER:$POSTGRES_PASSWORD@127.0.0.1:$POSTGRES_PORT/$POSTGRES_DB"
