#!/usr/bin/env bash
# Builds Jaeger $JAEGER_VERSION (an OTLP receiver with a query API, for the tracing test) from
# the Go module proxy, once, into $BIN_DIR/jaeger-$JAEGER_VERSION.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

dest="$BIN_DIR/jaeger-$JAEGER_VERSION/jaeger"
[ -x "$dest" ] && exit 0
command -v go >/dev/null || die "Go is required to build Jaeger (https://go.dev/dl)."
log "building Jaeger $JAEGER_VERSION from the Go module proxy (first time only, several minutes)"
work="$CACHE_DIR/jaeger-build"
rm -rf "$work" && mkdir -p "$work" "$(dirname "$dest")"
(
  cd "$work"
  go mod init gpumedic-testbed/jaeger >/dev/null 2>&1
  go get -tool "github.com/jaegertracing/jaeger/cmd/jaeger@$JAEGER_VERSION"
  go build -o "$dest.tmp" github.com/jaegertracing/jaeger/cmd/jaeger
) >"$CACHE_DIR/jaeger-build.log" 2>&1 || die "the Jaeger build failed; see $CACHE_DIR/jaeger-build.log"
mv "$dest.tmp" "$dest"
rm -rf "$work"
