#!/usr/bin/env bash
# Builds kube-apiserver, kubectl and etcd from the k8s.io/kubernetes Go module at the pinned release.
#
# k8s.io/kubernetes points its k8s.io/* staging modules at ./staging with replace directives, which
# a consumer cannot follow; this generates a small module that requires k8s.io/kubernetes and
# replaces every staging module with its published v0.x twin. etcd is built from the same module
# graph, so it is the etcd version that Kubernetes release itself was tested with.
# Binaries land in $CACHE_DIR/bin/kubernetes-$KUBERNETES_VERSION and are reused on the next run.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

out="$BIN_DIR/kubernetes-$KUBERNETES_VERSION"
if [ -x "$out/kube-apiserver" ] && [ -x "$out/kubectl" ] && [ -x "$out/etcd" ]; then
  exit 0
fi
command -v go >/dev/null || die "Go is required to build kube-apiserver (https://go.dev/dl)."

work="$CACHE_DIR/build/kubernetes-$KUBERNETES_VERSION"
mkdir -p "$work" "$out"
cd "$work"

minor="${KUBERNETES_VERSION#v1.}"   # 36.3
staging_version="v0.$minor"

log "building kube-apiserver, kubectl and etcd $KUBERNETES_VERSION (first time only; several minutes)"
export GOFLAGS=-mod=mod
gomod="$(go mod download -json "k8s.io/kubernetes@$KUBERNETES_VERSION" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')"
[ -f "$gomod" ] || die "could not download k8s.io/kubernetes@$KUBERNETES_VERSION from the Go module proxy"

{
  echo "module gpumedic.local/testbed-kubernetes"
  echo
  echo "go $(sed -n 's/^go \([0-9.]*\)$/\1/p' "$gomod")"
  echo
  echo "require k8s.io/kubernetes $KUBERNETES_VERSION"
  echo
  echo "replace ("
  # Every "k8s.io/foo => ./staging/src/k8s.io/foo" becomes "k8s.io/foo => k8s.io/foo v0.N.M".
  grep -oE 'k8s\.io/[a-z0-9-]+ => \./staging/src/k8s\.io/[a-z0-9-]+' "$gomod" | awk -v v="$staging_version" '{print "\t" $1 " => " $1 " " v}'
  echo ")"
} >go.mod

cat >tools.go <<'EOF'
//go:build tools

// Package tools pins the binaries the gpumedic testbed builds.
package tools

import (
	_ "go.etcd.io/etcd/server/v3"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
EOF

# go.etcd.io/etcd/server/v3 is only a test dependency of Kubernetes; add it at the version its
# go.mod names, so etcd matches the release.
etcd_version="$(sed -n 's/^[[:space:]]*go.etcd.io\/etcd\/server\/v3 \(v[0-9.]*\).*$/\1/p' "$gomod" | head -n1)"
[ -n "$etcd_version" ] || die "could not find the etcd server version in k8s.io/kubernetes's go.mod"
go get "go.etcd.io/etcd/server/v3@$etcd_version" >/dev/null
go mod tidy >/dev/null

ldflags="-s -w \
  -X k8s.io/component-base/version.gitVersion=$KUBERNETES_VERSION \
  -X k8s.io/component-base/version.gitMajor=1 \
  -X k8s.io/component-base/version.gitMinor=${minor%%.*} \
  -X k8s.io/client-go/pkg/version.gitVersion=$KUBERNETES_VERSION \
  -X k8s.io/client-go/pkg/version.gitMajor=1 \
  -X k8s.io/client-go/pkg/version.gitMinor=${minor%%.*}"
export CGO_ENABLED=0
go build -trimpath -ldflags "$ldflags" -o "$out/kube-apiserver.tmp" k8s.io/kubernetes/cmd/kube-apiserver
go build -trimpath -ldflags "$ldflags" -o "$out/kubectl.tmp" k8s.io/kubernetes/cmd/kubectl
go build -trimpath -ldflags "-s -w" -o "$out/etcd.tmp" go.etcd.io/etcd/server/v3
for b in kube-apiserver kubectl etcd; do mv "$out/$b.tmp" "$out/$b"; done
echo "$etcd_version" >"$out/etcd.version"
log "built $("$out/kube-apiserver" --version) and etcd $etcd_version into $out"
