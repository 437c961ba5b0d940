#!/usr/bin/env bash
# Installs Debian's headless-capable Chromium (package `chromium`) for the console's browser tests
# (services/console/tests/browser.rs), once: apt-get keeps the package in its cache, and a second
# run finds the binary and does nothing. Prints the binary's path.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

find_chromium() { command -v chromium || command -v chromium-browser || true; }

found="$(find_chromium)"
if [ -z "$found" ]; then
  log "installing Debian's chromium for the console's browser tests (first time only)"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 || {
    as_root apt-get update -q >/dev/null 2>&1
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null ||
      die "apt-get could not install chromium"
  }
  found="$(find_chromium)"
  [ -n "$found" ] || die "chromium is installed but not on PATH"
fi
echo "$found"
