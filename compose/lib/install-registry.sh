#!/usr/bin/env bash
# Builds Apicurio Registry $REGISTRY_VERSION (a schema registry with a Confluent-compatible API)
# from its Maven Central jars with the machine's Maven, once, into
# $CACHE_DIR/schema-registry-$REGISTRY_VERSION. See compose/registry/pom.xml for why a build.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

dest="$CACHE_DIR/schema-registry-$REGISTRY_VERSION"
[ -f "$dest/.complete" ] && exit 0
command -v java >/dev/null || die "Java 17 or newer is required for the schema registry (Debian: openjdk-17-jre-headless)."
command -v mvn >/dev/null || die "Maven is required to build the schema registry from Maven Central (Debian: maven)."

log "building Apicurio Registry $REGISTRY_VERSION from Maven Central (first time only, about a minute)"
# Built in a scratch copy, so the checkout gets no target/ folder.
work="$CACHE_DIR/schema-registry-build"
rm -rf "$work" "$dest" && mkdir -p "$work" "$dest"
cp -r "$COMPOSE_DIR/registry/pom.xml" "$COMPOSE_DIR/registry/src" "$work/"
mvn -B -q -s "$COMPOSE_DIR/registry/settings.xml" -f "$work/pom.xml" \
  -Dapicurio.version="$REGISTRY_VERSION" package >"$CACHE_DIR/schema-registry-build.log" 2>&1 ||
  die "the schema registry build failed; see $CACHE_DIR/schema-registry-build.log"
[ -f "$work/target/schema-registry-1-runner.jar" ] || die "Maven did not produce the registry's runner jar; see $CACHE_DIR/schema-registry-build.log"
mv "$work/target/schema-registry-1-runner.jar" "$work/target/lib" "$dest/"
rm -rf "$work"
touch "$dest/.complete"
