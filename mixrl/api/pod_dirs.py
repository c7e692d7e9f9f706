"""The directories a run's pods mount volumes of their own at (mixrl.operator.builders.podspec).

In :mod:`mixrl.api` because the weights store is mounted at ``weights.store`` beside them, and
validation refuses a store that would collide with one (a pod with two volumes at one path is
refused by the API server; one inside another's read-only volume cannot be created).
"""

from __future__ import annotations

CONFIG_DIR = "/etc/mixrl"
CACHE_DIR = "/var/cache/mixrl"
AUTH_DIR = "/var/run/mixrl/auth"
TMP_DIR = "/tmp"
ENGINE_WEIGHTS_DIR = "/var/lib/mixrl/engine-weights"
BUFFER_DATA_DIR = "/var/lib/mixrl/buffer"
TRAINER_RUN_DIR = "/var/lib/mixrl/trainer"

POD_DIRS = (CONFIG_DIR, CACHE_DIR, AUTH_DIR, TMP_DIR, ENGINE_WEIGHTS_DIR, BUFFER_DATA_DIR, TRAINER_RUN_DIR)


def store_dir(store: str) -> str:
    """The directory ``weights.store`` names (a ``file://`` URL's path, or the path itself)."""
    return store.removeprefix("file://")


def colliding_dir(store: str) -> str | None:
    """The pod directory the store is, or lies in (``/`` for the root itself), or None."""
    path = store_dir(store).rstrip("/") or "/"
    if path == "/":
        return "/"
    return next((d for d in POD_DIRS if path == d or path.startswith(d + "/")), None)
