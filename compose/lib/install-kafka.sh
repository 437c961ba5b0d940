#!/usr/bin/env bash
# Resolves the Apache Kafka broker jars from Maven Central with the machine's Maven, once, into
# $CACHE_DIR/kafka-$KAFKA_VERSION/libs. The broker then runs from that classpath with Java 17.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

libs="$CACHE_DIR/kafka-$KAFKA_VERSION/libs"
[ -f "$libs/.complete" ] && exit 0
command -v java >/dev/null || die "Java 17 or newer is required for Kafka (Debian: openjdk-17-jre-headless)."
command -v mvn >/dev/null || die "Maven is required to fetch Kafka from Maven Central (Debian: maven)."

log "fetching Apache Kafka $KAFKA_VERSION from Maven Central (first time only)"
rm -rf "$libs" && mkdir -p "$libs"
mvn -B -q -f "$COMPOSE_DIR/kafka/pom.xml" \
  -Dkafka.version="$KAFKA_VERSION" \
  dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$libs"
ls "$libs"/kafka_2.13-*.jar >/dev/null 2>&1 || die "Maven did not deliver kafka_2.13-$KAFKA_VERSION.jar"
touch "$libs/.complete"
