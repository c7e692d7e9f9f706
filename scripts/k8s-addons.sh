#!/usr/bin/env bash
# scripts/k8s-addons.sh [NAME...]: build the pinned cluster add-ons the test bed runs beside its
# control plane, from their Go modules, into a cache outside the repository (reused when present):
#   kueue   gang admission, quotas per GPU flavour     (sigs.k8s.io/kueue, cmd/kueue)
#   lws     LeaderWorkerSet, multi-node engine pools   (sigs.k8s.io/lws, cmd)
# Each lands in $MIXRL_CACHE/k8s-addons/<name>-<version>-r<recipe>/ as bin/<name> beside the
# module's config/ (CRDs, RBAC, webhooks: what its release manifests are made of). With no NAME,
# every add-on. Prints one line per add-on asked: "<name> <directory>".
set -euo pipefail

# name → Go module, version, main package (relative to the module)
declare -A MODULE=([kueue]=sigs.k8s.io/kueue [lws]=sigs.k8s.io/lws)
declare -A VERSION=([kueue]=v0.17.0 [lws]=v0.9.0)  # lws: the newest the module proxy serves here
declare -A MAIN=([kueue]=cmd/kueue [lws]=cmd)

# Bump when the build recipe changes (flags, what is copied), so cached builds are redone.
RECIPE=1

CACHE=${MIXRL_CACHE:-$HOME/.cache/mixrl}
log() { echo "k8s-addons: $*" >&2; }
fail() { echo "k8s-addons: $*" >&2; exit 1; }

names=("$@")
[ ${#names[@]} -gt 0 ] || names=(kueue lws)
for name in "${names[@]}"; do
  [ -n "${MODULE[$name]:-}" ] || fail "unknown add-on '$name' (known: ${!MODULE[*]})"
done

build() {
  local name=$1 mod=${MODULE[$1]} version=${VERSION[$1]}
  local dir="$CACHE/k8s-addons/$name-$version-r$RECIPE"
  if [ -x "$dir/bin/$name" ] && [ -d "$dir/config" ]; then
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
  (cd "$src" && GOFLAGS="${GOFLAGS:-} -trimpath" CGO_ENABLED=0 \
    go build -ldflags "-s -w" -o "$tmp/bin/$name" "./${MAIN[$name]}") 2>"$tmp/build.err" ||
    fail "building $name $version failed: $(tail -n 1 "$tmp/build.err")"
  cp -r "$src/config" "$tmp/config"
  chmod -R u+w "$tmp/config"
  rm -f "$tmp/fetch.err" "$tmp/build.err"
  rm -rf "$dir" && mv "$tmp" "$dir"
  log "$name $version ready in $(($(date +%s) - started)) s"
  echo "$name $dir"
}

for name in "${names[@]}"; do build "$name"; done
