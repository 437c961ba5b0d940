#!/usr/bin/env bash
# The Kafka ACLs of gpumedic's principals: one user per service, allowed only what that service
# does, and an operator for the CLI (docs/deploy.md, "Kafka principals and ACLs"). Run it as a
# Kafka admin against a cluster with an authorizer; adding an ACL that exists changes nothing, so
# it is safe to run again. The test services/runtime/tests/kafka_acls.rs runs this script against
# a broker with SASL/SCRAM and StandardAuthorizer and checks every grant and refusal.
#
#   scripts/kafka-acls.sh --bootstrap HOST:PORT --command-config FILE [options]
#
#   --bootstrap HOST:PORT   a listener the admin can use
#   --command-config FILE   the admin's client properties (security.protocol, sasl.*, ssl.*)
#   --topic-prefix P        the topics are P + health.raw.v1, health.enriched.v1, verdicts.v1,
#                           actions.v1, node-tokens.v1, and each input's dead-letter topic
#                           (+ .dlq)
#                           (default: gpumedic.)
#   --group-prefix P        the consumer groups are P + enricher, classifier, remediator; the
#                           CLI's replay readers P + replay-* (default: gpumedic-)
#   --user-prefix P         the principals are User:P + collector, enricher, classifier,
#                           remediator, console, operator (default: gpumedic-)
#   --kafka-libs DIR        run the ACL tool from a Kafka install's libs/ folder with java,
#                           rather than kafka-acls.sh from PATH
#   --print                 print the kafka-acls.sh commands instead of running them
#
# What each principal may do (Describe comes with every topic it uses; Create lets a service
# create its own topics at start when they are missing, as it does; it changes no existing topic):
#   collector   write raw, node-tokens (its token, once per rotation)
#   enricher    read raw (group enricher), node-tokens (no group); write raw.dlq, enriched
#   classifier  read enriched, actions (group classifier); write enriched.dlq, actions.dlq, verdicts
#   remediator  read verdicts (group remediator); write verdicts.dlq, actions
#   console     read verdicts (groups console-*: one per replica, started at the end); write nothing
#   operator    read and write every topic under the prefix (gpumedic inject, replay republish,
#               topics create); read in the groups replay-*
set -euo pipefail

usage() {
  sed -n '8,23p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 64
}

bootstrap="" command_config="" topic_prefix="gpumedic." group_prefix="gpumedic-" user_prefix="gpumedic-"
kafka_libs="" print=false
while [ $# -gt 0 ]; do
  case "$1" in
    --bootstrap) bootstrap="${2:-}"; shift 2 ;;
    --command-config) command_config="${2:-}"; shift 2 ;;
    --topic-prefix) topic_prefix="${2:-}"; shift 2 ;;
    --group-prefix) group_prefix="${2:-}"; shift 2 ;;
    --user-prefix) user_prefix="${2:-}"; shift 2 ;;
    --kafka-libs) kafka_libs="${2:-}"; shift 2 ;;
    --print) print=true; shift ;;
    -h | --help) usage ;;
    *) echo "kafka-acls.sh: unknown argument '$1'" >&2; usage ;;
  esac
done
[ -n "$bootstrap" ] || { echo "kafka-acls.sh: --bootstrap is required" >&2; usage; }
[ -n "$command_config" ] || { echo "kafka-acls.sh: --command-config is required" >&2; usage; }
if ! $print; then
  [ -r "$command_config" ] || { echo "kafka-acls.sh: cannot read --command-config $command_config" >&2; exit 66; }
  if [ -n "$kafka_libs" ]; then
    [ -d "$kafka_libs" ] || { echo "kafka-acls.sh: --kafka-libs $kafka_libs is not a folder" >&2; exit 66; }
    command -v java >/dev/null || { echo "kafka-acls.sh: java is required with --kafka-libs" >&2; exit 69; }
  else
    command -v kafka-acls.sh >/dev/null ||
      { echo "kafka-acls.sh: kafka-acls.sh is not on PATH: add Kafka's bin/ to PATH or pass --kafka-libs" >&2; exit 69; }
  fi
fi

raw="${topic_prefix}health.raw.v1"
enriched="${topic_prefix}health.enriched.v1"
verdicts="${topic_prefix}verdicts.v1"
actions="${topic_prefix}actions.v1"
node_tokens="${topic_prefix}node-tokens.v1"

# acl PRINCIPAL ARGS...: one kafka-acls.sh --add, printed, or started in the background (each is a
# JVM that mostly waits to start; they do not depend on each other).
pids=() logs=()
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
acl() {
  local principal="$1"; shift
  local args=(--bootstrap-server "$bootstrap" --command-config "$command_config" --add
    --allow-principal "User:${user_prefix}${principal}" "$@")
  if $print; then
    echo "kafka-acls.sh ${args[*]}"
    return
  fi
  local log="$work/${#pids[@]}.log"
  echo "kafka-acls.sh ${args[*]}" >"$log"
  if [ -n "$kafka_libs" ]; then
    # A short-lived tool: the quick JIT and a small heap start it fastest.
    java -Xmx256m -XX:TieredStopAtLevel=1 -XX:+UseSerialGC -cp "$kafka_libs/*" \
      org.apache.kafka.tools.AclCommand "${args[@]}" >>"$log" 2>&1 &
  else
    kafka-acls.sh "${args[@]}" >>"$log" 2>&1 &
  fi
  pids+=($!) logs+=("$log")
}

# service NAME GROUP INPUTS OUTPUTS: a consuming stage reads its inputs in its group and writes
# its outputs and each input's dead-letter topic; it may create all of them.
service() {
  local name="$1" group="$2" inputs=($3) outputs=($4) t
  local read=() write=() create=()
  for t in "${inputs[@]}"; do read+=(--topic "$t"); write+=(--topic "$t.dlq"); create+=(--topic "$t" --topic "$t.dlq"); done
  for t in "${outputs[@]}"; do write+=(--topic "$t"); create+=(--topic "$t"); done
  acl "$name" --operation Read --operation Describe "${read[@]}" --group "$group"
  acl "$name" --operation Write --operation Describe "${write[@]}"
  acl "$name" --operation Create "${create[@]}"
}

acl collector --operation Write --operation Describe --operation Create --topic "$raw" --topic "$node_tokens"
service enricher "${group_prefix}enricher" "$raw" "$enriched"
# The node-token directory: every enricher replica reads all of it, assigned, in no group.
acl enricher --operation Read --operation Describe --operation Create --topic "$node_tokens"
service classifier "${group_prefix}classifier" "$enriched $actions" "$verdicts"
service remediator "${group_prefix}remediator" "$verdicts" "$actions"
acl console --operation Read --operation Describe --topic "$verdicts"
acl console --operation Read --resource-pattern-type prefixed --group "${group_prefix}console-"
acl operator --operation Read --operation Write --operation Describe --operation Create \
  --resource-pattern-type prefixed --topic "$topic_prefix"
acl operator --operation Read --operation Describe --resource-pattern-type prefixed --group "${group_prefix}replay-"

failed=0
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then
    failed=$((failed + 1))
    echo "kafka-acls.sh: this command failed:" >&2
    cat "${logs[$i]}" >&2
  fi
done
if [ "$failed" -gt 0 ]; then
  echo "kafka-acls.sh: $failed of ${#pids[@]} ACL commands failed (see above); running this script again is safe" >&2
  exit 1
fi
$print || echo "kafka-acls.sh: ${#pids[@]} ACL commands applied for User:${user_prefix}{collector,enricher,classifier,remediator,operator}" >&2
