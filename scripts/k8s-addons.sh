#!/usr/bin/env bash
# scripts/k8s-addons.sh [NAME...]: build the pinned cluster add-ons the test bed runs beside its
# control plane, from their Go modules, into a cache outside the repository (reused when present):
#   kueue   gang admission, quotas per GPU flavour     (sigs.k8s.io/kueue, cmd/kueue)
#   lws     LeaderWorkerSet, multi-node engine pools   (sigs.k8s.io/lws, cmd)
#   keda    event-driven autoscaling (ScaledObjects)   (github.com/kedacore/keda/v2, cmd/operator
#           and cmd/adapter: its operator and its external metrics API server)
# Each lands in $MIXRL_CACHE/k8s-addons/<name>-<version>-r<recipe>/ as bin/<binary>... beside the
# module's config/ (CRDs, RBAC, webhooks: what its release manifests are made of). With no NAME,
# every add-on. Prints one line per add-on asked: "<name> <directory>".
set -euo pipefail

# name → Go module, version, binaries as "<binary>=<main package relative to the module>"...
declare -A MODULE=([kueue]=sigs.k8s.io/kueue [lws]=sigs.k8s.io/lws [keda]=github.com/kedacore/keda/v2)
# lws: the newest the module proxy serves here; keda: the newest whose go directive (1.26.0) the
# installed Go 1.26 meets, so no toolchain download
declare -A VERSION=([kueue]=v0.17.0 [lws]=v0.9.0 [keda]=v2.21.0)
# keda's admission webhooks (cmd/webhooks) are left out: they only validate ScaledObjects, and
# the operator's own builder is what the bed exercises
declare -A MAIN=([kueue]="kueue=cmd/kueue" [lws]="lws=cmd"
  [keda]="keda-operator=cmd/operator keda-adapter=cmd/adapter")

# Bump when the build recipe changes (flags, what is copied), so cached builds are redone.
RECIPE=1

CACHE=${MIXRL_CACHE:-$HOME/.cache/mixrl}
log() { echo "k8s-addons: $*" >&2; }
fail() { echo "k8s-addons: $*" >&2; exit 1; }

names=("$@")
[ ${#names[@]} -gt 0 ] || names=(kueue lws keda)
for name in "${names[@]}"; do
  [ -n "${MODULE[$name]:-}" ] || fail "unknown add-on '$name' (known: ${!MODULE[*]})"
done

build() {
  local name=$1 mod=${MODULE[$1]} version=${VERSION[$1]}
  local dir="$CACHE/k8s-addons/$name-$version-r$RECIPE" binary ready=1
  for binary in ${MAIN[$name]}; do [ -x "$dir/bin/${binary%%=*}" ] || ready=0; done
  if [ $ready = 1 ] && [ -d "$dir/config" ]; then
    echo "$name $dir"
    return
  fi
  command -v go >/dev/null || fail "no 'go' on PATH; install Go >= 1.26 (the add-ons are built from Go modules)"
  local started tmp src
  started=$(date +%s)
  tmp="$dir.tmp"
  rm -rf "$tmp" && mkdir -p "$tmp/bin"
  log "fetching $mod $version from the Go module proxy"
  src=$(cd "$tmp" && go mod download -json "$mod@$version" 2>"$tmp/fetch.err" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p') ||
    true
  [ -n "$src" ] && [ -d "$src" ] ||
    fail "cannot download $mod@$version from the Go module proxy ($(go env GOPROXY)): $(tail -n 1 "$tmp/fetch.err")"
  log "compiling $name $version (a few minutes the first time; cached afterwards)"
  for binary in ${MAIN[$name]}; do
    (cd "$src" && GOFLAGS="${GOFLAGS:-} -trimpath" CGO_ENABLED=0 \
      go build -ldflags "-s -w" -o "$tmp/bin/${binary%%=*}" "./${binary#*=}") 2>"$tmp/build.err" ||
      fail "building $name $version (${binary#*=}) failed: $(tail -n 1 "$tmp/build.err")"
  done
  cp -r "$src/config" "$tmp/config"
  chmod -R u+w "$tmp/config"
  rm -f "$tmp/fetch.err" "$tmp/build.err"
  rm -rf "$dir" && mv "$tmp" "$dir"
  log "$name $version ready in $(($(date +%s) - started)) s"
  echo "$name $dir"
}

for name in "${names[@]}"; do build "$name"; done
