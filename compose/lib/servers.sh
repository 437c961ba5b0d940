# shellcheck shell=bash
# Start functions for each testbed server. Each is idempotent: a server that already answers is
# left alone. Sourced by compose/up.

# ---------------------------------------------------------------------------------------------
# Debian packages: PostgreSQL, kcat, and what the Rust build needs (cmake for librdkafka, curl
# headers, protoc for tonic's codegen). Installed only when missing.
install_debian_packages() {
  local missing=()
  command -v cmake >/dev/null || missing+=(cmake)
  command -v protoc >/dev/null || missing+=(protobuf-compiler)
  command -v kcat >/dev/null || missing+=(kcat)
  [ -f /usr/include/x86_64-linux-gnu/curl/curl.h ] || [ -f /usr/include/curl/curl.h ] || missing+=(libcurl4-openssl-dev)
  command -v openssl >/dev/null || missing+=(openssl)
  compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || missing+=(postgresql)
  command -v java >/dev/null || missing+=(openjdk-17-jre-headless)
  command -v mvn >/dev/null || missing+=(maven)
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing Debian packages: ${missing[*]}"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 || {
    as_root apt-get update -q >/dev/null 2>&1
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null ||
      die "apt-get could not install: ${missing[*]}"
  }
}

# ---------------------------------------------------------------------------------------------
# PostgreSQL: a cluster of the testbed's own, in .testbed/postgres, on its own port.
pg_bin() { ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n1; }

# PostgreSQL refuses to run as root; when we are root, its commands run as the postgres user.
as_pg_user() {
  if [ "$(id -u)" -eq 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

# pg_root: a folder holding the cluster (data/) and its log that the server's user can reach.
# As root the server runs as `postgres`, which cannot enter a checkout under a private home
# (/root is 0700); then the cluster lives under /var/tmp, named after this checkout.
pg_root() {
  if [ "$(id -u)" -ne 0 ] || runuser -u postgres -- test -x "$STATE_DIR" 2>/dev/null; then
    echo "$STATE_DIR/postgres"
  else
    echo "/var/tmp/gpumedic-testbed-$(printf '%s' "$STATE_DIR" | sha1sum | cut -c1-12)/postgres"
  fi
}

start_postgres() {
  local bin root data log
  bin="$(pg_bin)"
  root="$(pg_root)"
  data="$root/data"
  log="$root/postgres.log"
  if port_open "$POSTGRES_PORT"; then
    return 0
  fi
  mkdir -p "$root"
  if [ "$(id -u)" -eq 0 ]; then chown postgres "$root"; fi
  if [ ! -f "$data/PG_VERSION" ]; then
    log "initialising PostgreSQL in $data"
    rm -rf "$data"
    printf '%s\n' "$POSTGRES_PASSWORD" >"$root/pgpass.tmp"
    if [ "$(id -u)" -eq 0 ]; then chown postgres "$root/pgpass.tmp"; fi
    as_pg_user "$bin/initdb" -D "$data" -U "$POSTGRES_USER" --pwfile="$root/pgpass.tmp" \
      --auth-local=trust --auth-host=scram-sha-256 -E UTF8 --locale=C.UTF-8 >"$LOG_DIR/postgres-init.log" 2>&1 ||
      die "initdb failed; see $LOG_DIR/postgres-init.log"
    rm -f "$root/pgpass.tmp"
    cat >>"$data/postgresql.conf" <<EOF
# gpumedic testbed
listen_addresses = '127.0.0.1'
port = $POSTGRES_PORT
unix_socket_directories = '$data'
max_connections = 300
shared_buffers = 256MB
# At 10,000 events/s the default 1 GB of WAL checkpointed every 22-28 s, and commits in the
# checkpoints' sync phase took 120-290 ms (docs/benchmarks.md, fleet scale).
max_wal_size = 4GB
checkpoint_timeout = 15min
EOF
  fi
  as_pg_user "$bin/pg_ctl" -D "$data" -l "$log" -w -t 60 start >/dev/null ||
    die "PostgreSQL did not start; see $log"
  ln -sf "$log" "$LOG_DIR/postgres.log"
  if ! as_pg_user "$bin/psql" -h "$data" -p "$POSTGRES_PORT" -U "$POSTGRES_USER" -d postgres -tAc \
    "SELECT 1 FROM pg_database WHERE datname = '$POSTGRES_DB'" | grep -q 1; then
    as_pg_user "$bin/createdb" -h "$data" -p "$POSTGRES_PORT" -U "$POSTGRES_USER" "$POSTGRES_DB"
  fi
}

stop_postgres() {
  local data
  data="$(pg_root)/data"
  [ -f "$data/postmaster.pid" ] || return 0
  as_pg_user "$(pg_bin)/pg_ctl" -D "$data" -m fast -w -t 60 stop >/dev/null 2>&1 || true
}

# ---------------------------------------------------------------------------------------------
# Apache Kafka in KRaft mode: one process that is both broker and controller.
start_kafka() {
  local libs="$CACHE_DIR/kafka-$KAFKA_VERSION/libs" dir="$STATE_DIR/kafka"
  if port_open "$KAFKA_PORT"; then
    return 0
  fi
  mkdir -p "$dir"
  cat >"$dir/server.properties" <<EOF
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=127.0.0.1:$KAFKA_CONTROLLER_PORT
listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT,CONTROLLER://127.0.0.1:$KAFKA_CONTROLLER_PORT
advertised.listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT,CONTROLLER://127.0.0.1:$KAFKA_CONTROLLER_PORT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs=$dir/data
num.partitions=3
auto.create.topics.enable=false
offsets.topic.replication.factor=1
offsets.topic.num.partitions=10
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
message.max.bytes=4194304
EOF
  local java_opts=(-Xms256m -Xmx1g -XX:+UseG1GC -Djava.awt.headless=true
    "-Dlog4j2.configurationFile=$COMPOSE_DIR/kafka/log4j2.properties")
  if [ ! -f "$dir/data/meta.properties" ]; then
    log "formatting Kafka storage in $dir/data"
    local cluster_id
    cluster_id="$(java -cp "$libs/*" "${java_opts[@]}" kafka.tools.StorageTool random-uuid 2>/dev/null | tail -n1)"
    java -cp "$libs/*" "${java_opts[@]}" kafka.tools.StorageTool format --standalone \
      -t "$cluster_id" -c "$dir/server.properties" >"$LOG_DIR/kafka-format.log" 2>&1 ||
      die "Kafka storage format failed; see $LOG_DIR/kafka-format.log"
  fi
  start_daemon kafka "$LOG_DIR/kafka.log" java -cp "$libs/*" "${java_opts[@]}" kafka.Kafka "$dir/server.properties"
  wait_for "Kafka" 90 port_open "$KAFKA_PORT" || die "Kafka did not open port $KAFKA_PORT; see $LOG_DIR/kafka.log"
}

# ---------------------------------------------------------------------------------------------
# Apicurio Registry: the schema registry, Confluent-compatible API under /apis/ccompat/v7.
# In-memory storage (H2): its schemas and ids do not survive a restart.
registry_ready() {
  curl -fsS "$SCHEMA_REGISTRY_URL/subjects"
}

start_registry() {
  local dir="$CACHE_DIR/schema-registry-$REGISTRY_VERSION"
  if port_open "$SCHEMA_REGISTRY_PORT"; then
    registry_ready >/dev/null 2>&1 ||
      die "something on port $SCHEMA_REGISTRY_PORT is not a schema registry (no answer at $SCHEMA_REGISTRY_URL/subjects); stop it or set GPUMEDIC_SCHEMA_REGISTRY_PORT"
    return 0
  fi
  start_daemon schema-registry "$LOG_DIR/schema-registry.log" java -Xms64m -Xmx512m -Djava.awt.headless=true \
    -Dquarkus.http.host=127.0.0.1 -Dquarkus.http.port="$SCHEMA_REGISTRY_PORT" \
    -jar "$dir/schema-registry-1-runner.jar"
  wait_for "schema registry" 120 registry_ready ||
    die "the schema registry did not answer at $SCHEMA_REGISTRY_URL/subjects; see $LOG_DIR/schema-registry.log"
}

# ---------------------------------------------------------------------------------------------
# Jaeger: OTLP in on $OTLP_GRPC_PORT (gRPC) and $OTLP_HTTP_PORT, the query API on
# $JAEGER_QUERY_PORT; traces in memory.
jaeger_ready() { curl -fsS "$JAEGER_QUERY_URL/api/services" >/dev/null; }

start_jaeger() {
  if port_open "$JAEGER_QUERY_PORT"; then
    jaeger_ready || die "something on port $JAEGER_QUERY_PORT is not Jaeger (no answer at $JAEGER_QUERY_URL/api/services)"
    return 0
  fi
  port_open "$OTLP_GRPC_PORT" && die "port $OTLP_GRPC_PORT (OTLP) is taken by something else; set GPUMEDIC_OTLP_GRPC_PORT"
  GPUMEDIC_OTLP_GRPC_PORT="$OTLP_GRPC_PORT" GPUMEDIC_OTLP_HTTP_PORT="$OTLP_HTTP_PORT" \
    GPUMEDIC_JAEGER_QUERY_PORT="$JAEGER_QUERY_PORT" GPUMEDIC_JAEGER_QUERY_GRPC_PORT="$JAEGER_QUERY_GRPC_PORT" \
    start_daemon jaeger "$LOG_DIR/jaeger.log" "$BIN_DIR/jaeger-$JAEGER_VERSION/jaeger" \
    --config "$COMPOSE_DIR/jaeger/config.yaml"
  wait_for "jaeger" 60 jaeger_ready || die "Jaeger did not answer at $JAEGER_QUERY_URL; see $LOG_DIR/jaeger.log"
}

# ---------------------------------------------------------------------------------------------
# etcd and kube-apiserver, with generated certificates and an admin kubeconfig (as envtest does).
k8s_bin() { echo "$BIN_DIR/kubernetes-$KUBERNETES_VERSION"; }

start_etcd() {
  if port_open "$ETCD_PORT"; then
    return 0
  fi
  mkdir -p "$STATE_DIR/etcd"
  start_daemon etcd "$LOG_DIR/etcd.log" "$(k8s_bin)/etcd" \
    --name testbed --data-dir "$STATE_DIR/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster "testbed=http://127.0.0.1:$ETCD_PEER_PORT" --unsafe-no-fsync
  wait_for "etcd" 60 curl -fsS "http://127.0.0.1:$ETCD_PORT/health" || die "etcd did not become healthy; see $LOG_DIR/etcd.log"
}

# make_pki: a CA, the apiserver's serving certificate, an admin client certificate in
# system:masters, and the service-account signing key pair. Made once per testbed.
make_pki() {
  local pki="$STATE_DIR/pki"
  [ -f "$pki/admin.crt" ] && return 0
  mkdir -p "$pki" && cd "$pki"
  openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=gpumedic-testbed-ca" \
    -keyout ca.key -out ca.crt 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -subj "/CN=kube-apiserver" -keyout apiserver.key -out apiserver.csr 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes.default.svc\nextendedKeyUsage=serverAuth\n' >apiserver.ext
  openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 \
    -extfile apiserver.ext -out apiserver.crt 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -subj "/O=system:masters/CN=gpumedic-admin" -keyout admin.key -out admin.csr 2>/dev/null
  printf 'extendedKeyUsage=clientAuth\n' >admin.ext
  openssl x509 -req -in admin.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 \
    -extfile admin.ext -out admin.crt 2>/dev/null
  openssl genrsa -out sa.key 2048 2>/dev/null
  openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
  cd - >/dev/null
}

write_kubeconfig() {
  local pki="$STATE_DIR/pki"
  cat >"$KUBECONFIG_PATH" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: gpumedic-testbed
  cluster:
    server: https://127.0.0.1:$APISERVER_PORT
    certificate-authority-data: $(base64 -w0 "$pki/ca.crt")
users:
- name: gpumedic-admin
  user:
    client-certificate-data: $(base64 -w0 "$pki/admin.crt")
    client-key-data: $(base64 -w0 "$pki/admin.key")
contexts:
- name: gpumedic-testbed
  context:
    cluster: gpumedic-testbed
    user: gpumedic-admin
current-context: gpumedic-testbed
EOF
}

apiserver_ready() {
  curl -fsS --cacert "$STATE_DIR/pki/ca.crt" --cert "$STATE_DIR/pki/admin.crt" --key "$STATE_DIR/pki/admin.key" \
    "https://127.0.0.1:$APISERVER_PORT/readyz"
}

start_apiserver() {
  make_pki
  write_kubeconfig
  if port_open "$APISERVER_PORT"; then
    # Certificates belong to a checkout: an apiserver started from another one rejects ours.
    apiserver_ready >/dev/null 2>&1 ||
      die "a kube-apiserver on port $APISERVER_PORT rejects this checkout's credentials; another testbed is running (stop it with its own compose/down, or set GPUMEDIC_APISERVER_PORT and GPUMEDIC_ETCD_PORT)"
    return 0
  fi
  local pki="$STATE_DIR/pki"
  # No controller-manager runs, so nothing would create the default ServiceAccount a pod refers
  # to: the ServiceAccount admission plugin is off, as in controller-runtime's envtest.
  # GPU quarantine writes DeviceTaintRules (resource.k8s.io/v1beta2): the gate is beta but off by
  # default in 1.36, and the beta API version is not served unless asked for.
  start_daemon kube-apiserver "$LOG_DIR/kube-apiserver.log" "$(k8s_bin)/kube-apiserver" \
    --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
    --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$APISERVER_PORT" \
    --cert-dir "$pki" --tls-cert-file "$pki/apiserver.crt" --tls-private-key-file "$pki/apiserver.key" \
    --client-ca-file "$pki/ca.crt" \
    --service-account-key-file "$pki/sa.pub" --service-account-signing-key-file "$pki/sa.key" \
    --service-account-issuer https://kubernetes.default.svc \
    --authorization-mode RBAC --allow-privileged=true \
    --service-cluster-ip-range 10.96.0.0/16 \
    --disable-admission-plugins ServiceAccount \
    --max-requests-inflight 2000 --max-mutating-requests-inflight 1000 \
    --enable-priority-and-fairness=false \
    --feature-gates DRADeviceTaintRules=true \
    --runtime-config resource.k8s.io/v1beta2=true
  wait_for "kube-apiserver" 120 apiserver_ready ||
    die "kube-apiserver did not become ready; see $LOG_DIR/kube-apiserver.log"
}
