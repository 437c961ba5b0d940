#!/usr/bin/env bash
# Builds Prometheus's promtool $PROMETHEUS_VERSION (it checks and unit-tests the alerting rules in
# k8s/components/prometheus-rules) from the Go module proxy, once, into
# $BIN_DIR/promtool-$PROMETHEUS_VERSION. The alert tests find it there.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

dest="$BIN_DIR/promtool-$PROMETHEUS_VERSION/promtool"
[ -x "$dest" ] && exit 0
command -v go >/dev/null || die "Go is required to build promtool (https://go.dev/dl)."
log "building promtool $PROMETHEUS_VERSION from the Go module proxy (first time only, several minutes)"
work="$CACHE_DIR/promtool-build"
rm -rf "$work" && mkdir -p "$work" "$(dirname "$dest")"
(
  cd "$work"
  go mod init gpumedic-testbed/promtool >/dev/null 2>&1
  go get -tool "github.com/prometheus/prometheus/cmd/promtool@$PROMETHEUS_VERSION"
  go build -o "$dest.tmp" github.com/prometheus/prometheus/cmd/promtool
) >"$CACHE_DIR/promtool-build.log" 2>&1 || die "the promtool build failed; see $CACHE_DIR/promtool-build.log"
mv "$dest.tmp" "$dest"
rm -rf "$work"
