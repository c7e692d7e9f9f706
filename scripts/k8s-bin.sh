#!/usr/bin/env bash
# Build the pinned binaries of the local Kubernetes test bed from Go modules, into a cache outside
# the repository (reused when present):
#   kube-apiserver, kube-controller-manager, kube-scheduler, kubectl,
#   kubelet, kube-proxy (the bed's real node)                          (k8s.io/kubernetes)
#   etcd                                                               (go.etcd.io/etcd/server/v3)
#   kwok                                                               (sigs.k8s.io/kwok)
#   helm                                                               (helm.sh/helm/v3)
#   coredns (Service DNS for the real node's pods)                     (github.com/coredns/coredns)
# Prints the bin directory on its last line. Environment:
#   MIXRL_CACHE   cache root (default ~/.cache/mixrl); binaries land in $MIXRL_CACHE/k8s/<versions>/bin
#   GOFLAGS etc.  passed through to go
set -euo pipefail

K8S_VERSION=v1.37.2      # k8s.io/kubernetes; its staging modules are v0.<minor>.<patch>
ETCD_VERSION=v3.6.16     # go.etcd.io/etcd/server/v3 (the API server of 1.37 wants etcd >= 3.5)
KWOK_VERSION=v0.8.0      # sigs.k8s.io/kwok
HELM_VERSION=v3.22.0     # helm.sh/helm/v3
COREDNS_VERSION=v1.15.0  # github.com/coredns/coredns

# Kubernetes' go.mod replaces each of these by ./staging/src/...; outside its repository every one is
# pinned to the matching published version instead (the usual way to build it as a dependency).
STAGING="api apiextensions-apiserver apimachinery apiserver cli-runtime client-go cloud-provider
cluster-bootstrap code-generator component-base component-helpers controller-manager cri-api
cri-client cri-streaming csi-translation-lib dynamic-resource-allocation endpointslice externaljwt
kms kube-aggregator kube-controller-manager kube-proxy kube-scheduler kubectl kubelet metrics
mount-utils pod-security-admission sample-apiserver sample-cli-plugin sample-controller streaming"

# Bump when the build recipe changes (flags, stamping), so cached binaries are rebuilt.
RECIPE=3

CACHE=${MIXRL_CACHE:-$HOME/.cache/mixrl}
ROOT="$CACHE/k8s/k8s-$K8S_VERSION-etcd-$ETCD_VERSION-kwok-$KWOK_VERSION-helm-$HELM_VERSION-coredns-$COREDNS_VERSION-r$RECIPE"
BIN="$ROOT/bin"
BINARIES="kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy etcd kwok helm coredns"

log() { echo "k8s-bin: $*" >&2; }
fail() { echo "k8s-bin: $*" >&2; exit 1; }

missing=""
for b in $BINARIES; do [ -x "$BIN/$b" ] || missing="$missing $b"; done
if [ -z "$missing" ]; then
  echo "$BIN"
  exit 0
fi

command -v go >/dev/null || fail "no 'go' on PATH; install Go >= 1.26 (the test bed is built from Go modules)"
export GOFLAGS="${GOFLAGS:-} -trimpath"
export CGO_ENABLED=0
mkdir -p "$BIN" "$ROOT/src"
ldflags="-s -w"
started=$(date +%s)
step=0
total=$(echo "$missing" | wc -w)

# Fails with one line naming the module when the proxy cannot be reached or refuses a version.
fetch() {
  local mod=$1 dir=$2
  (cd "$dir" && go mod download "$mod" >/dev/null 2>"$ROOT/fetch.err") ||
    fail "cannot download $mod from the Go module proxy ($(go env GOPROXY)): $(tail -n 1 "$ROOT/fetch.err")"
}

built() {
  step=$((step + 1))
  log "[$step/$total] $1 built ($(($(date +%s) - started)) s elapsed)"
}

k8s_wanted=""
for b in kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy; do
  case " $missing " in *" $b "*) k8s_wanted="$k8s_wanted $b" ;; esac
done
if [ -n "$k8s_wanted" ]; then
  mod="$ROOT/src/kubernetes"
  mkdir -p "$mod"
  minor=${K8S_VERSION#v1.}
  {
    echo "module mixrl.dev/k8s-tools"
    echo
    echo "go 1.26.0"
    echo
    echo "require k8s.io/kubernetes $K8S_VERSION"
    echo
    for s in $STAGING; do echo "replace k8s.io/$s => k8s.io/$s v0.$minor"; done
  } >"$mod/go.mod"
  log "fetching k8s.io/kubernetes $K8S_VERSION and its dependencies (first time: a few hundred MB)"
  fetch "k8s.io/kubernetes@$K8S_VERSION" "$mod"
  pkgs=""
  for b in $k8s_wanted; do pkgs="$pkgs k8s.io/kubernetes/cmd/$b"; done
  # `go mod tidy` needs importable packages; the commands are programs, so resolve by `go get`.
  (cd "$mod" && go get $pkgs >"$ROOT/get.log" 2>&1) || fail "resolving Kubernetes' dependencies failed: $(tail -n 1 "$ROOT/get.log")"
  # Stamp the version as Kubernetes' own build does (hack/lib/version.sh): the API server reports it
  # in /version, and Helm checks charts' kubeVersion against it.
  major=${K8S_VERSION#v}; major=${major%%.*}
  minor_only=${minor%%.*}
  stamp=""
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    stamp="$stamp -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor_only"
    stamp="$stamp -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  done
  log "compiling$k8s_wanted (several minutes on 2 cores)"
  (cd "$mod" && go build -ldflags "$ldflags$stamp" -o "$BIN/" $pkgs) || fail "building Kubernetes$k8s_wanted failed (see above)"
  for b in $k8s_wanted; do built "$b"; done
fi

case " $missing " in *" etcd "*)
  mod="$ROOT/src/etcd"
  mkdir -p "$mod"
  # etcd's server module carries replace directives, so `go install …@version` refuses it.
  printf 'module mixrl.dev/etcd-tools\n\ngo 1.26.0\n\nrequire go.etcd.io/etcd/server/v3 %s\n' "$ETCD_VERSION" >"$mod/go.mod"
  log "fetching and compiling etcd $ETCD_VERSION"
  fetch "go.etcd.io/etcd/server/v3@$ETCD_VERSION" "$mod"
  (cd "$mod" && go get go.etcd.io/etcd/server/v3 >"$ROOT/get.log" 2>&1) || fail "resolving etcd's dependencies failed: $(tail -n 1 "$ROOT/get.log")"
  (cd "$mod" && go build -ldflags "$ldflags" -o "$BIN/etcd" go.etcd.io/etcd/server/v3) || fail "building etcd failed (see above)"
  built etcd
  ;;
esac

install_plain() {
  local name=$1 pkg=$2 version=$3
  log "fetching and compiling $name $version"
  GOBIN="$BIN" go install -ldflags "$ldflags" "$pkg@$version" 2>"$ROOT/install.err" ||
    fail "go install $pkg@$version failed: $(tail -n 1 "$ROOT/install.err")"
  built "$name"
}
case " $missing " in *" kwok "*) install_plain kwok sigs.k8s.io/kwok/cmd/kwok "$KWOK_VERSION" ;; esac
case " $missing " in *" helm "*) install_plain helm helm.sh/helm/v3/cmd/helm "$HELM_VERSION" ;; esac
case " $missing " in *" coredns "*) install_plain coredns github.com/coredns/coredns "$COREDNS_VERSION" ;; esac

for b in $BINARIES; do [ -x "$BIN/$b" ] || fail "$b is missing from $BIN after the build"; done
log "all binaries ready in $(($(date +%s) - started)) s"
echo "$BIN"
