#!/usr/bin/env bash
# Create or reuse .venv and install mixrl with everything the tests need. (The Kubernetes test bed's
# binaries, Helm among them, come from scripts/k8s-bin.sh, which `make test` runs.)
# TORCH_SPEC overrides the torch requirement (default torch==2.13.0 from the index pip is configured
# with: on Linux PyPI's CUDA build, which runs on CPU too; on macOS the CPU build). The CPU-only Linux
# build: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu TORCH_SPEC="torch==2.13.0+cpu".
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
VENV=${VENV:-.venv}
stamp="$VENV/.mixrl-installed"
want="$(cat pyproject.toml images/constraints.txt | sha256sum | cut -c1-16) $TORCH_SPEC"

# uv installs the environment: from its cache (outside the repository, kept by `dev-cluster down`)
# a new .venv takes seconds where pip took minutes (torch and its CUDA libraries are 4.5 GB). It is
# pinned and fetched once by pip into its own directory. Runtime dependencies at the images' pins
# (images/constraints.txt), so the tests run what the images run and a new upstream release cannot
# change a clean clone's environment; the dev tools at their newest within pyproject's ranges.
UV_VERSION=0.13.9
uv_dir=${MIXRL_UV_DIR:-$HOME/.cache/mixrl/uv-$UV_VERSION}
export UV_CACHE_DIR=${UV_CACHE_DIR:-$HOME/.cache/mixrl/uv-cache}
if [ ! -x "$uv_dir/bin/uv" ]; then
  echo "setup: fetching uv $UV_VERSION into $uv_dir"
  rm -rf "$uv_dir.partial"
  "$PYTHON" -m pip install -q --disable-pip-version-check --target "$uv_dir.partial" "uv==$UV_VERSION" 2>&1 \
    | grep -v "as the 'root' user" || true
  "$uv_dir.partial/bin/uv" --version >/dev/null # fail loudly if the install did not work
  rm -rf "$uv_dir" && mv "$uv_dir.partial" "$uv_dir"
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing $TORCH_SPEC and mixrl[dev] into $VENV (uv; cache $UV_CACHE_DIR; the first time downloads about 5 GB)"
  # pip's settings carry over (its environment, else its configuration files): its index, an extra
  # index (the CPU-only torch) and find-links;
  # unsafe-best-match picks versions across indexes as pip does; --system-certs trusts the system's CAs.
  uv_args=(--python "$VENV/bin/python" --system-certs --index-strategy unsafe-best-match
    --constraint images/constraints.txt)
  pip_setting() { # $1: the environment variable, $2: pip's configuration key
    if [ -n "${!1:-}" ]; then echo "${!1}"; else "$PYTHON" -m pip config get "$2" 2>/dev/null || true; fi
  }
  index=$(pip_setting PIP_INDEX_URL global.index-url)
  [ -z "$index" ] || uv_args+=(--index-url "$index")
  for extra in $(pip_setting PIP_EXTRA_INDEX_URL global.extra-index-url); do uv_args+=(--extra-index-url "$extra"); done
  for links in $(pip_setting PIP_FIND_LINKS global.find-links); do [ ! -d "$links" ] || uv_args+=(--find-links "$links"); done
  started=$(date +%s)
  # --compile-bytecode: pip compiled every module at install; without it, where
  # PYTHONDONTWRITEBYTECODE is set (CI machines set it), every process compiles what it imports,
  # each time (measured: a test starting five engines 40 s instead of 20 s).
  # uv's own progress lines stay; the list of the 130-odd packages it installed goes
  "$uv_dir/bin/uv" pip install --compile-bytecode "${uv_args[@]}" "$TORCH_SPEC" -e '.[dev]' 2>&1 | { grep -v '^ [-+~] ' || true; }
  "$VENV/bin/python" -c "import torch, transformers, kopf, mixrl" # fail loudly if the install did not work
  echo "$want" > "$stamp"
  echo "setup: $VENV ready in $(($(date +%s) - started)) s"
fi

# SGLang's own argument parser checks every launch flag the operator generates (tests/sglang/). The
# pinned release (SGLANG_VERSION in mixrl/api/resolve.py) goes into its own directory outside the
# repository, with --no-deps and only the pure-Python packages its parser imports; the tests run it
# with .venv's interpreter (torch, numpy, pydantic from there), so nothing lands in .venv itself.
if [ "${MIXRL_SKIP_SGLANG:-0}" != 1 ]; then
  sglang_version=$("$VENV/bin/python" -c "from mixrl.api.resolve import SGLANG_VERSION; print(SGLANG_VERSION)")
  sglang_env=${MIXRL_SGLANG_ENV:-$HOME/.cache/mixrl/sglang-$sglang_version}
  sglang_pkgs="sglang==$sglang_version orjson psutil pybase64 starlette msgspec pyzmq ipython traitlets"
  if [ "$(cat "$sglang_env/.mixrl-installed" 2>/dev/null)" != "$sglang_pkgs" ]; then
    if [ -e "$sglang_env" ] && [ ! -f "$sglang_env/.mixrl-installed" ]; then
      echo "setup: $sglang_env exists and is not an SGLang environment setup made; move it or set MIXRL_SGLANG_ENV" >&2
      exit 1
    fi
    echo "setup: installing SGLang $sglang_version's argument parser into $sglang_env (test-only): $sglang_pkgs"
    staging="$sglang_env.partial"
    rm -rf "$staging" && mkdir -p "$staging"
    # shellcheck disable=SC2086  # the package list is meant to split
    "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --target "$staging" $sglang_pkgs
    PYTHONPATH="$staging" "$VENV/bin/python" -c "import sglang.srt.server_args" # fail loudly
    echo "$sglang_pkgs" > "$staging/.mixrl-installed"
    rm -rf "$sglang_env" && mv "$staging" "$sglang_env"
    echo "setup: SGLang $sglang_version's parser ready ($(du -sh "$sglang_env" | cut -f1))"
  fi
fi

# Tests that need a real Prometheus server use the Debian package; install it when we can.
if [ "${MIXRL_SKIP_PROMETHEUS:-0}" != 1 ] && ! command -v prometheus >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing Debian's prometheus package (for the autoscaling tests)"
    (apt-get install -y -qq prometheus >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq prometheus >/dev/null 2>&1; }) \
      || echo "setup: could not install prometheus; the tests that need it will fail"
  fi
fi

# The sandbox that runs model-generated code (mixrl/rl/sandbox/, docs/sandbox.md) is bubblewrap.
if [ "${MIXRL_SKIP_BWRAP:-0}" != 1 ] && ! command -v bwrap >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing Debian's bubblewrap package (for the sandbox tests)"
    (apt-get install -y -qq bubblewrap >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq bubblewrap >/dev/null 2>&1; }) \
      || echo "setup: could not install bubblewrap; the tests that need it will fail"
  fi
fi

# The test bed's real node (mixrl/devcluster/node.py, docs/dev-cluster.md): Debian's containerd,
# runc, CNI plugins, nftables, conntrack and a static busybox (the pause and shell images); buildah
# and mmdebstrap build the project's images without a registry (scripts/images.sh).
real_node_pkgs="containerd runc containernetworking-plugins nftables conntrack busybox-static buildah mmdebstrap"
if [ "${MIXRL_SKIP_REAL_NODE:-0}" != 1 ]; then
  absent=""
  for pkg in $real_node_pkgs; do dpkg -s "$pkg" >/dev/null 2>&1 || absent="$absent $pkg"; done
  if [ -n "$absent" ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "setup: installing Debian's$absent (for the test bed's real node)"
      # shellcheck disable=SC2086  # the package list is meant to split
      (apt-get install -y -qq $absent >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq $absent >/dev/null 2>&1; }) \
        || echo "setup: could not install$absent; the real-node tests will fail"
    else
      echo "setup: the real-node tests need Debian's$absent (install them as root); they will fail without"
    fi
  fi
fi
