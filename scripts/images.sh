#!/usr/bin/env bash
# Build mixrl's own images from images/*/Dockerfile for the test bed's real nodes: with buildah,
# offline (every RUN step has --network none), on a Python base made here with mmdebstrap, and write
# them as one OCI archive that containerd imports (`ctr images import`). Cached outside the repository
# by the content hash of what goes in; a run with nothing changed builds nothing.
#
#   scripts/images.sh [--check] [COMPONENT...]     (as root; COMPONENT: operator components
#                                                   engine-torch trainer-torch; default all four)
#
# stdout: one line per image, "<component> <reference> <absolute path of the OCI archive>" (the same
# archive on every line), e.g.
#   operator mixrl.dev/mixrl-operator:dev-0123456789ab /root/.cache/mixrl/images/archives/images-456789abcdef.tar
# stderr: progress, with the seconds elapsed. --check also runs each image's entry point (runc, uid
# 1000, read-only root, a tmpfs at /tmp as the pods' emptyDir, no network) and fails if one fails.
#
# Not built: images/sglang and images/trainer-megatron (their bases are lmsysorg/sglang and NVIDIA's
# PyTorch container, which no registry here serves), and nothing GPU-specific is checked.
#
# What goes in, each cached under $CACHE (${MIXRL_CACHE:-~/.cache/mixrl}/images):
#   wheels/      the wheelhouse: `pip download` on this host (its pip configuration, index and
#                find-links) of TORCH_SPEC, mixrl's dependencies at images/constraints.txt's pins,
#                pyarrow and the build backend, for the base's Python and glibc; the builds install
#                from it only (PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheelhouse, mounted read-only)
#   base/        the rootfs tar of the base: mmdebstrap of Debian bookworm (Python 3.11, passwd for
#                useradd, bubblewrap at the components Dockerfile's pin, ca-certificates, netbase)
#                with a virtual environment /opt/venv first on PATH, so `python` and `pip` behave as
#                in python:3.11-slim (Debian's PEP 668 marker stays; it does not apply in a venv)
#   buildah/     buildah's storage: the base image, the layer cache (the torch layer is made once
#                and shared by components, engine-torch and trainer-torch), the built images
#   oci/         an OCI layout of the current images, layers uncompressed: a layer already there
#                is not written again (after a source change, only mixrl's own layers are)
#   archives/    images-<hash12>.tar: one OCI archive of the images asked for, each layer once
#                (the torch layer is shared by three images), uncompressed, each image named by
#                its io.containerd.image.name annotation; only the latest archive is kept
# Environment:
#   TORCH_SPEC   torch requirement (default torch==2.13.0: on Linux PyPI's CUDA build, ~4.5 GB)
#   TORCH_INDEX  an extra index for torch (e.g. https://download.pytorch.org/whl/cpu with
#                TORCH_SPEC=torch==2.13.0+cpu); default: only the index pip is configured with
#   MIXRL_CACHE  cache root (default ~/.cache/mixrl)
#   MIXRL_DEBIAN_MIRROR  Debian mirror for mmdebstrap (default http://deb.debian.org/debian)
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${MIXRL_CACHE:-$HOME/.cache/mixrl}/images
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TORCH_INDEX=${TORCH_INDEX:-}
MIRROR=${MIXRL_DEBIAN_MIRROR:-http://deb.debian.org/debian}
ALL="operator components engine-torch trainer-torch"
TORCH_IMAGES=" components engine-torch trainer-torch "
# Bump when the base recipe changes (packages, venv, config): the base and every image are rebuilt.
BASE_RECIPE=1

started=$SECONDS
log() { printf 'images: [%4ds] %s\n' $((SECONDS - started)) "$*" >&2; }
fail() { printf 'images: %s\n' "$*" >&2; exit 1; }

check=0
components=""
for arg in "$@"; do
  case $arg in
    --check) check=1 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    operator | components | engine-torch | trainer-torch) components="$components $arg" ;;
    *) fail "unknown argument '$arg' (components: $ALL; flags: --check)" ;;
  esac
done
components=${components:-$ALL}

[ "$(id -u)" = 0 ] || fail "must run as root (buildah's overlay storage, mmdebstrap and runc need it)"
command -v buildah >/dev/null || fail "buildah is missing (Debian: apt-get install buildah)"
command -v flock >/dev/null || fail "flock is missing (Debian: apt-get install util-linux)"
[ $check = 0 ] || command -v runc >/dev/null || fail "runc is missing, needed by --check (Debian: apt-get install runc)"

mkdir -p "$CACHE"/{archives,base,buildah,logs,tmp}
exec 9>"$CACHE/.lock"
flock -n 9 || { log "waiting for another scripts/images.sh on $CACHE"; flock 9; }
export TMPDIR="$CACHE/tmp" # containers/image unpacks oci-archives there (not /var/tmp)

B=(buildah --root "$CACHE/buildah/root" --runroot "$CACHE/buildah/run" --storage-driver overlay)
sha() { sha256sum | cut -c1-64; }
if [ -x "$REPO/.venv/bin/python" ]; then PIP=("$REPO/.venv/bin/python" -m pip); else PIP=(python3 -m pip); fi

# ---------------------------------------------------------------- what goes in, and its hashes
# A snapshot of the build context (what the Dockerfiles COPY, as their .dockerignore leaves it), so
# that edits made while this runs cannot give an image the wrong tag.
ctx="$CACHE/context"
rm -rf "$ctx" && mkdir -p "$ctx"
tar -C "$REPO" -cf - --exclude=__pycache__ --exclude='*.pyc' --exclude='*.egg-info' \
  pyproject.toml README.md mixrl images | tar -C "$ctx" -xf -
files_hash() { (cd "$ctx" && find "$@" -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum) | sha; }
src_hash=$(files_hash pyproject.toml README.md mixrl images/constraints.txt)
script_hash=$(sha <"$REPO/scripts/images.sh")

bwrap_version=$(sed -n 's/.*BWRAP=\([^;]*\);.*/\1/p' "$ctx/images/components/Dockerfile")
[ -n "$bwrap_version" ] || fail "no BWRAP=<version> in images/components/Dockerfile"
arch=$(uname -m)
case $arch in x86_64) deb_arch=amd64 ;; aarch64) deb_arch=arm64 ;; *) fail "unsupported machine $arch" ;; esac
base_packages="python3,python3-venv,passwd,bubblewrap=$bwrap_version,ca-certificates,netbase"
base_key=$(echo "recipe=$BASE_RECIPE bookworm $deb_arch $MIRROR $base_packages" | sha)
# The base's root file system, made once (delete base/ to take Debian's updates): the images' tags
# come from its content, so a new one gives new tags.
base_tar="$CACHE/base/$base_key.tar"
if [ ! -s "$base_tar" ] || [ ! -s "$base_tar.sha256" ]; then
  command -v mmdebstrap >/dev/null || fail "mmdebstrap is missing (Debian: apt-get install mmdebstrap)"
  log "base: mmdebstrap of Debian bookworm ($base_packages) from $MIRROR (a few minutes)"
  rm -f "$CACHE"/base/*
  mmdebstrap --variant=minbase --architectures="$deb_arch" --include="$base_packages" \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' --quiet bookworm "$base_tar.partial.tar" \
    "deb $MIRROR bookworm main" "deb $MIRROR bookworm-updates main" \
    "deb ${MIRROR%/debian}/debian-security bookworm-security main" >"$CACHE/logs/base.log" 2>&1 ||
    fail "mmdebstrap failed ($(tail -n 1 "$CACHE/logs/base.log")); log: $CACHE/logs/base.log"
  sha <"$base_tar.partial.tar" >"$base_tar.sha256"
  mv "$base_tar.partial.tar" "$base_tar"
fi
base_id=$(cat "$base_tar.sha256")
base_ref="localhost/mixrl-python:bookworm-${base_id:0:12}"

# Wheels for the base's interpreter and glibc (CPython 3.11, glibc 2.36), not this host's.
platforms=()
for v in $(seq 36 -1 5); do platforms+=(--platform "manylinux_2_${v}_$arch"); done
platforms+=(--platform "manylinux2014_$arch" --platform "manylinux2010_$arch" --platform "manylinux1_$arch")
requirements=$(python3 - "$ctx/pyproject.toml" <<'EOF'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))
deps = [d for d in project["project"]["dependencies"] if not d.replace(" ", "").lower().startswith("torch")]
print("\n".join(deps + ["pyarrow"] + project["build-system"]["requires"]))
EOF
)
torch_index_arg=${TORCH_INDEX:-${PIP_INDEX_URL:-$("${PIP[@]}" config get global.index-url 2>/dev/null || echo https://pypi.org/simple)}}
wheel_key=$( (echo "$TORCH_SPEC $TORCH_INDEX ${platforms[*]}"; echo "$requirements"; cat "$ctx/images/constraints.txt") | sha)
torch_key=$(echo "$TORCH_SPEC $torch_index_arg" | sha)

declare -A REF # of all four, so that cleaning up keeps the current images of each
for c in $ALL; do
  case $c in engine-torch) repo=mixrl.dev/mixrl-engine ;; *) repo=mixrl.dev/mixrl-$c ;; esac
  key=$( (echo "$script_hash $base_id $src_hash"
    [[ $TORCH_IMAGES == *" $c "* ]] && echo "$torch_key $wheel_key"
    cat "$ctx/images/$c/Dockerfile" "$ctx/images/$c/Dockerfile.dockerignore") | sha)
  REF[$c]="$repo:dev-${key:0:12}"
done
# One archive holds every image asked for: their shared layers are written (and imported) once.
asked=()
for c in $components; do asked+=("${REF[$c]}"); done
set_key=$(printf '%s\n' "${asked[@]}" | sha)
archive="$CACHE/archives/images-${set_key:0:12}.tar"

# ---------------------------------------------------------------- wheelhouse, base, builds
wheels="$CACHE/wheels"
ensure_wheels() {
  [ "$(cat "$wheels/.key" 2>/dev/null)" = "$wheel_key" ] && return
  log "wheelhouse: pip download of $TORCH_SPEC, mixrl's pinned dependencies, pyarrow, setuptools, wheel (several GB the first time)"
  mkdir -p "$wheels" && rm -f "$wheels/.key"
  extra=()
  [ -z "$TORCH_INDEX" ] || extra=(--extra-index-url "$TORCH_INDEX")
  # shellcheck disable=SC2046  # one requirement a line
  "${PIP[@]}" download --disable-pip-version-check --progress-bar off --dest "$wheels" \
    --only-binary=:all: --python-version 3.11 --implementation cp --abi cp311 "${platforms[@]}" \
    "${extra[@]}" --constraint "$ctx/images/constraints.txt" "$TORCH_SPEC" $(echo "$requirements" | tr '\n' ' ') \
    >"$CACHE/logs/wheels.log" 2>&1 ||
    fail "pip download failed ($(grep -E '^ERROR' "$CACHE/logs/wheels.log" | tail -n 1)); log: $CACHE/logs/wheels.log"
  # Keep only what this download named (an earlier key's wheels would otherwise linger).
  keep=$(sed -n -E 's#^ *(Saved|File was already downloaded) (.*/)?([^/ ]+\.whl)$#\3#p' "$CACHE/logs/wheels.log" | sort -u)
  if echo "$keep" | grep -q '^torch-'; then
    for f in "$wheels"/*.whl; do echo "$keep" | grep -qxF "$(basename "$f")" || rm -f "$f"; done
  fi
  echo "$wheel_key" >"$wheels/.key"
  log "wheelhouse: $(find "$wheels" -name '*.whl' | wc -l) wheels, $(du -sh "$wheels" | cut -f1)"
}

ensure_base() {
  local tar=$base_tar
  "${B[@]}" inspect --type image "$base_ref" >/dev/null 2>&1 && return
  log "base: $base_ref from $(du -h "$tar" | cut -f1) rootfs, with /opt/venv"
  local c
  c=$("${B[@]}" from scratch)
  "${B[@]}" add "$c" "$tar" / >/dev/null
  "${B[@]}" run --network none "$c" -- python3 -m venv /opt/venv
  "${B[@]}" config --env PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 --cmd python3 --created-by "scripts/images.sh: mmdebstrap bookworm, python3 -m venv /opt/venv" "$c"
  "${B[@]}" commit --quiet --rm "$c" "$base_ref" >/dev/null
}

# buildah's storage holds one generation (base, wheelhouse): when either changes, every layer would
# be rebuilt anyway, so the old ones go.
ensure_generation() {
  local gen="$base_id $wheel_key" f="$CACHE/buildah/generation"
  [ "$(cat "$f" 2>/dev/null)" = "$gen" ] && return
  if [ -s "$f" ]; then
    log "buildah storage: base or wheelhouse changed, removing the previous images and layers"
    "${B[@]}" rm --all >/dev/null 2>&1 || true
    "${B[@]}" rmi --all --force >/dev/null 2>&1 || true
  fi
  echo "$gen" >"$f"
}

# Blob store: an OCI layout ($CACHE/oci) of every current image with its layers uncompressed. A push
# into it skips each layer already there (same digest), so after a source change only mixrl's own
# layers are written again; a push of an image with several new layers goes through dir: first,
# which writes them uncompressed (the oci transport would gzip them: slower to write and to unpack).
store="$CACHE/oci"
oci() { python3 "$CACHE/tmp/oci.py" "$@"; }
write_oci_helper() {
  cat >"$CACHE/tmp/oci.py" <<'EOF'
"""The blob store and the archives: missing, adopt, archive, gc (see scripts/images.sh)."""
import json, os, sys, tarfile

def blob(store, digest):
    return os.path.join(store, "blobs", *digest.split(":", 1))

def index(store):
    path = os.path.join(store, "index.json")
    return json.load(open(path)) if os.path.exists(path) else {"schemaVersion": 2, "manifests": []}

def manifest_of(store, ref):
    for entry in index(store)["manifests"]:
        if entry.get("annotations", {}).get("org.opencontainers.image.ref.name") == ref:
            return entry, json.load(open(blob(store, entry["digest"])))
    raise SystemExit(f"images: {ref} is not in {store}")

command, store, *args = sys.argv[1:]
if command == "missing":  # how many of the image's layers (`buildah inspect` on stdin) the store lacks
    print(sum(not os.path.exists(blob(store, d)) for d in json.load(sys.stdin)["OCIv1"]["rootfs"]["diff_ids"]))
elif command == "adopt":  # move the blobs of a dir: copy into the store
    os.makedirs(os.path.join(store, "blobs", "sha256"), exist_ok=True)
    for name in os.listdir(args[0]):
        if len(name) == 64 and not os.path.exists(blob(store, "sha256:" + name)):
            os.rename(os.path.join(args[0], name), blob(store, "sha256:" + name))
elif command == "archive":  # images as one OCI archive, each blob once, named as `ctr images import` reads them
    out, *refs = args
    entries, digests = [], []
    for ref in refs:
        entry, manifest = manifest_of(store, ref)
        digests += [entry["digest"], manifest["config"]["digest"]] + [layer["digest"] for layer in manifest["layers"]]
        entry = {k: entry[k] for k in ("mediaType", "digest", "size")}
        entry["annotations"] = {"io.containerd.image.name": ref, "org.opencontainers.image.ref.name": ref.rsplit(":", 1)[1]}
        entries.append(entry)
    files = {"oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
             "index.json": json.dumps({"schemaVersion": 2, "manifests": entries}).encode()}
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        tar.copybufsize = 1 << 20
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, __import__("io").BytesIO(data))
        for digest in dict.fromkeys(digests):
            info = tar.gettarinfo(blob(store, digest), "blobs/" + digest.replace(":", "/"))
            info.mtime, info.uid, info.gid, info.uname, info.gname, info.mode = 0, 0, 0, "", "", 0o644
            with open(blob(store, digest), "rb") as f:
                tar.addfile(info, f)
elif command == "gc":  # keep the named images and their blobs only
    keep = set(args)
    idx = index(store)
    idx["manifests"] = [m for m in idx["manifests"] if m.get("annotations", {}).get("org.opencontainers.image.ref.name") in keep]
    used = set()
    for entry in idx["manifests"]:
        manifest = json.load(open(blob(store, entry["digest"])))
        used |= {entry["digest"], manifest["config"]["digest"]} | {layer["digest"] for layer in manifest["layers"]}
    with open(os.path.join(store, "index.json"), "w") as f:
        json.dump(idx, f)
    directory = os.path.join(store, "blobs", "sha256")
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        if "sha256:" + name not in used:
            os.remove(os.path.join(directory, name))
EOF
}

build() {
  local c=$1 ref=${REF[$1]} args=() rc missing
  if [[ $TORCH_IMAGES == *" $c "* ]]; then
    args+=(--build-arg "TORCH_SPEC=$TORCH_SPEC" --build-arg "TORCH_INDEX=$torch_index_arg")
  fi
  if ! "${B[@]}" inspect --type image "$ref" >/dev/null 2>&1; then
    log "$c: building $ref (images/$c/Dockerfile)"
    set +e
    "${B[@]}" bud --layers --pull-never --isolation oci --network none \
      --volume "$wheels:/wheelhouse:ro" --build-arg PIP_NO_INDEX=1 --build-arg PIP_FIND_LINKS=/wheelhouse \
      --build-arg "PYTHON_IMAGE=$base_ref" "${args[@]}" \
      --ignorefile "$ctx/images/$c/Dockerfile.dockerignore" -f "$ctx/images/$c/Dockerfile" -t "$ref" "$ctx" \
      2>&1 | tee "$CACHE/logs/$c.log" | {
      # One line per RUN and COPY step as it starts, or once it is found in the layer cache.
      step=""
      while IFS= read -r line; do
        case $line in
          "--> Using cache"*) [ -z "$step" ] || log "$c: $step (cached)"; step="" ;;
          *" STEP "*": RUN "* | *" STEP "*": COPY "*)
            [ -z "$step" ] || log "$c: $step"
            step=${line#*STEP }; step=${step:0:110} ;;
          *) [ -z "$step" ] || log "$c: $step"; step="" ;;
        esac
      done
    }
    rc=${PIPESTATUS[0]}
    set -e
    [ "$rc" = 0 ] || { tail -n 20 "$CACHE/logs/$c.log" >&2; fail "$c: buildah bud failed; log: $CACHE/logs/$c.log"; }
  fi
  missing=$("${B[@]}" inspect --type image "$ref" | oci missing "$store")
  log "$c: exporting ($missing layers not in the blob store yet)"
  if [ "$missing" -gt 2 ]; then
    rm -rf "$CACHE/tmp/dir"
    "${B[@]}" push --quiet --disable-compression "$ref" "dir:$CACHE/tmp/dir"
    oci adopt "$store" "$CACHE/tmp/dir"
    rm -rf "$CACHE/tmp/dir"
  fi
  "${B[@]}" push --quiet "$ref" "oci:$store:$ref"
  log "$c: $ref"
}

prune() {
  local c=$1 repo=${REF[$1]%:*} name
  for name in $("${B[@]}" images --noheading --format '{{.Name}}:{{.Tag}}' 2>/dev/null | grep -F "$repo:" || true); do
    [ "$name" = "${REF[$c]}" ] || "${B[@]}" rmi --force "$name" >/dev/null 2>&1 || true
  done
}

if [ ! -s "$archive" ]; then
  log "to build:$components (cache $CACHE)"
  ensure_wheels
  ensure_generation
  ensure_base
  write_oci_helper
  for c in $components; do build "$c"; done
  oci gc "$store" "${REF[@]}"
  rm -f "$archive.partial"
  oci archive "$store" "$archive.partial" "${asked[@]}"
  mv "$archive.partial" "$archive"
  log "archive: $(du -h "$archive" | cut -f1) for ${#asked[@]} images ($archive)"
fi
for f in "$CACHE"/archives/*; do
  [ -e "$f" ] && [ "$f" != "$archive" ] && rm -f "$f" && log "removed the superseded $(basename "$f")"
done
for c in $components; do prune "$c"; done
rm -rf "$CACHE/tmp"/* "$ctx"

# ---------------------------------------------------------------- --check: run each entry point
check_image() {
  local c=$1 script ctr mnt bundle rc
  local common='set -e; [ "$(id -u):$(id -g)" = 1000:1000 ]
    if touch /probe 2>/dev/null; then echo "the root file system is writable" >&2; exit 1; fi
    mixrl --help >/dev/null'
  case $c in
    operator) script='mixrl operator --help >/dev/null
      python -c "import kopf, kubernetes, mixrl.operator.main, mixrl.operator.autoscaling.loop, mixrl.operator.controller.handlers, mixrl.operator.controller.observer, importlib.util as u; assert u.find_spec(\"torch\") is None"' ;;
    components) script='bwrap --version
      python -c "import torch, pyarrow, mixrl.rl.router, mixrl.rl.buffer, mixrl.rl.rollout.worker, mixrl.rl.engine.weight_sync; print(\"torch\", torch.__version__, \"pyarrow\", pyarrow.__version__)"' ;;
    engine-torch) script='mixrl engine --help >/dev/null; python -c "import torch, mixrl; print(\"torch\", torch.__version__)"' ;;
    trainer-torch) script='mixrl trainer --help >/dev/null; torchrun --help >/dev/null; python -c "import torch, mixrl.rl.trainer.main; print(\"torch\", torch.__version__)"' ;;
  esac
  ctr=$("${B[@]}" from --quiet "${REF[$c]}")
  mnt=$("${B[@]}" mount "$ctr")
  bundle="$CACHE/tmp/check-$c"
  mkdir -p "$bundle"
  "${B[@]}" inspect --type container "$ctr" | python3 -c 'import json, sys; print(json.dumps(json.load(sys.stdin)["OCIv1"]["config"]["Env"]))' >"$bundle/env.json"
  runc spec --bundle "$bundle"
  python3 - "$bundle" "$mnt" "$common
$script" <<'EOF'
import json, sys
bundle, rootfs, script = sys.argv[1:]
path = f"{bundle}/config.json"
spec = json.load(open(path))
spec["root"] = {"path": rootfs, "readonly": True}
process = spec["process"]
process.update(terminal=False, cwd="/", args=["/bin/sh", "-c", script], user={"uid": 1000, "gid": 1000},
               env=json.load(open(f"{bundle}/env.json")) + ["HOME=/tmp"])
process["capabilities"] = {k: [] for k in ("bounding", "effective", "permitted", "inheritable", "ambient")}  # drop ALL
process["noNewPrivileges"] = True
# /tmp as the pods have it (an emptyDir); the spec's own namespaces include a new, empty network one.
spec["mounts"].append({"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
                       "options": ["nosuid", "nodev", "mode=1777", "size=256m"]})
json.dump(spec, open(path, "w"))
EOF
  set +e
  runc run --bundle "$bundle" "mixrl-images-check-$c-$$" </dev/null >"$CACHE/logs/check-$c.log" 2>&1
  rc=$?
  set -e
  "${B[@]}" umount "$ctr" >/dev/null
  "${B[@]}" rm "$ctr" >/dev/null
  rm -rf "$bundle"
  [ $rc = 0 ] || { cat "$CACHE/logs/check-$c.log" >&2; fail "$c: the check failed in ${REF[$c]}"; }
  log "$c: check passed as uid 1000, read-only root, no network ($(tr '\n' ' ' <"$CACHE/logs/check-$c.log"))"
}
if [ $check = 1 ]; then
  for c in $components; do check_image "$c"; done
fi

for c in $components; do echo "$c ${REF[$c]} $archive"; done
log "done"
