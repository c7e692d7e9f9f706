"""``mixrl engine-sync``: keep one engine on the run's latest weight version, at its pool's precision.

It runs in every engine pod: with ``--once`` as the init container (prepare the checkpoint the
engine starts from), then as the ``weight-sync`` sidecar (follow the weight store).

- The trainer publishes BF16 versions to the weight store: a full snapshot every
  ``weights.snapshotEvery`` versions, deltas on the previous version in between.
- An SGLang pool serves a version converted to its precision (``WeightStore.convert``: written
  once per precision into the shared store, atomically, by the one replica holding the
  conversion's lease while the others wait for it).  The torch engine emulates its precision
  itself and loads the BF16 version, rebuilding a delta version from its chain.
- A version whose chain is broken (a delta or a base missing or damaged) is refused with one line;
  the sidecar then serves the newest version it can load (the last snapshot or a version whose
  chain is whole) and asks the trainer for a snapshot (``WeightStore.request_snapshot``), which
  its next publish writes.  A version removed while it was being synced (a resumed trainer,
  prune) is not broken: the sidecar serves the newest older one that loads and asks for nothing.
- ``<output>/current`` is a symlink to the checkpoint the engine should serve; SGLang's
  ``--model-path`` points at it, so a restarted engine starts from the latest version.  For the
  torch engine on a delta version it names the chain's snapshot (``from_pretrained`` needs whole
  weights); an engine restarted from it is unlabelled, and the sidecar loads the latest into it.
- A version is told apart by its number and the sha256 of its manifest (:class:`Loaded`): a
  trainer that resumes from an older checkpoint removes the versions after it and publishes the
  same numbers again with other weights.  The sidecar keeps what the engine holds (in memory and in
  ``<output>/loaded``, beside the readiness gate's ``labelled``, for a restarted sidecar; the init
  container writes it for the checkpoint it links).
- When the store's latest version differs from the one the engine holds (its number, or its
  manifest: republished under the same number), the sidecar calls
  ``/update_weights_from_disk`` with ``flush_cache: false``.  The torch engine prepares the version
  beside the served weights while it keeps decoding and swaps between two decode steps; an SGLang
  engine is paused ``in_place`` for the load and continued: sessions keep going, their next tokens come from the new weights and carry the new
  version.  SGLang refuses a cache flush while requests are running or queued (after an in-place
  pause they still are): the update would load the weights, answer ``success: false`` and keep
  reporting the old version.  The price of not flushing: prefixes cached before the update keep
  the KV the previous version computed until they are evicted (docs/engine.md, "Weight updates
  under load").
- An engine started from ``current`` reports no version of its own (SGLang's ``default``) until
  its first update; the pod's command line cannot carry one (the init container picks the version
  after the pod spec is written).  When ``current`` already is the latest version's checkpoint and
  ``loaded`` records that version with the manifest the store has now, the sidecar labels the engine
  with ``/update_weight_version`` instead of reloading the same weights.  Sound because ``current``
  and ``loaded`` move only after the engine confirms an update, so an engine that never took one
  serves what they named when it started.  The exception: a ``current`` naming a version that is
  gone (a resumed trainer or prune removed it) is re-linked to the newest version that loads at
  once, engine up or not (an engine restarted from it could never load); ``loaded`` is left naming
  the gone version, so an unlabelled engine is then reloaded, not labelled.  Every other unlabelled
  engine is reloaded too (an unknown ``loaded``, another version or manifest): version 0 is both
  SGLang's ``default`` and the first version, so the number alone cannot say what it holds.
- Those calls change the engine's state, so they carry the run's token (``--auth-token-file``, a
  mounted Secret, or ``$MIXRL_AUTH_TOKEN``); it goes with every request, as SGLang's ``--api-key``
  wants it even on ``/get_weight_version``.  The sidecar refuses to follow without one unless
  ``--insecure-no-auth``; an engine that answers 401 stops it with one line (a wrong Secret does not
  fix itself by retrying).  ``--once`` never calls the engine and needs no token.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from mixrl.api.launch import LABELLED_FILE
from mixrl.api.loader import RunConfigError, load_resolved
from mixrl.api.resolve import ENGINE_PORT, ResolvedPool, ResolvedRun
from mixrl.rl.auth import AuthConfigError, add_auth_arguments, token_from_args
from mixrl.rl.engine.client import EngineClient, EngineError
from mixrl.rl.serving import stop_on_signals
from mixrl.rl.weights import DELTA, MANIFEST, WeightStore, WeightStoreError

log = logging.getLogger("mixrl.engine_sync")


class SyncError(Exception):
    """A problem the sidecar reports in one line (bad arguments, an engine that refuses a version)."""


def checkpoint_for(store: WeightStore, pool: ResolvedPool, version: int) -> str:
    """The directory the pool's engine loads for ``version`` (converting it when SGLang needs that)."""
    if pool.engine == "sglang":
        return store.convert(version, pool.weight_precision)
    return store.path(version)


def startup_checkpoint(store: WeightStore, pool: ResolvedPool, version: int, target: str) -> str:
    """What ``output/current`` names once the engine serves ``version`` from ``target``: ``target``,
    except for a torch engine on a delta version.  The torch engine starts with transformers'
    ``from_pretrained``, which needs whole weights, so ``current`` then names the chain's snapshot:
    an engine restarted from it is unlabelled, and the sidecar loads ``version`` into it."""
    if pool.engine != "sglang" and store.manifest(version).get("kind") == DELTA:
        return store.path(store.chain(version)[0])
    return target


def point_current(output: Path, target: str) -> Path:
    """Atomically make ``output/current`` a symlink to ``target``."""
    output.mkdir(parents=True, exist_ok=True)
    link = output / "current"
    staged = output / f".current.{os.getpid()}"
    staged.unlink(missing_ok=True)
    staged.symlink_to(target, target_is_directory=True)
    os.replace(staged, link)
    return link


async def wait_for_version(
    store: WeightStore, poll_s: float, timeout_s: float, progress_s: float = 10.0
) -> int:
    """The latest version, waiting (with a progress line every ``progress_s``) while there is none."""
    start = last_report = time.monotonic()
    while True:
        latest = await asyncio.to_thread(store.latest)
        if latest is not None:
            return latest
        now = time.monotonic()
        if timeout_s and now - start > timeout_s:
            raise SyncError(f"no weight version appeared in {store.url} within {timeout_s:.0f} s")
        if now - last_report >= progress_s:
            log.info("waiting for the first weight version in %s (%.0f s so far)", store.url, now - start)
            last_report = now
        await asyncio.sleep(poll_s)


def fall_back(store: WeightStore, version: int, verify_snapshot: bool = True) -> int | None:
    """Where to go when ``version`` cannot be served: None when its chain in the store is whole
    (the failure was not the store's); else the newest older version whose chain is whole
    (SyncError when there is none), after asking the trainer for a snapshot unless ``version`` was
    removed.  ``verify_snapshot``: hash the snapshots' files (False: sizes only, the load hashes)."""
    problem = store.chain_problem(version, verify_snapshot)
    if problem is None:
        return None
    if version not in store.versions():
        # Removed (a resumed trainer, prune), not broken: a snapshot request would only make the
        # trainer's next publish a full snapshot instead of a delta, for nothing.
        fallback = store.newest_loadable(below=version, verify_snapshot=verify_snapshot)
        if fallback is None:
            raise SyncError(f"version {version} was removed and no older version loads")
        log.info("weight version %d was removed meanwhile; version %d loads", version, fallback)
        return fallback
    log.warning("weight version %d cannot be rebuilt: %s", version, problem)
    store.request_snapshot(f"a loader could not rebuild version {version}: {problem}")
    fallback = store.newest_loadable(below=version, verify_snapshot=verify_snapshot)
    if fallback is None:
        raise SyncError(f"version {version} cannot be rebuilt and no older version can ({problem})")
    log.warning("falling back to version %d until the requested snapshot is published", fallback)
    return fallback


async def prepare(
    store: WeightStore, pool: ResolvedPool, output: Path, poll_s: float, timeout_s: float
) -> int:
    """``--once``: the latest version's checkpoint for this pool, linked as ``output/current``
    (an older one when the latest's chain is broken; choosing it hashes no snapshot's files, the
    engine's load does that), and recorded as what the engine will hold (``output/loaded``)."""
    latest = await wait_for_version(store, poll_s, timeout_s)
    version, target = await link_loadable(store, pool, output, latest)
    # Read after the link and before the engine starts: a version republished in between leaves
    # a digest that no longer matches, so the sidecar reloads rather than labels.
    record_loaded(output, await asyncio.to_thread(identity_of, store, version))
    log.info("pool %s starts from version %d: %s", pool.name, version, target)
    return version


async def link_loadable(store: WeightStore, pool: ResolvedPool, output: Path, latest: int) -> tuple[int, str]:
    """Link ``output/current`` to ``latest``'s checkpoint for this pool, or to the newest older
    version that loads when ``latest``'s chain is broken; returns the version and the target."""
    fallback = await asyncio.to_thread(fall_back, store, latest, False)
    version = latest if fallback is None else fallback
    try:
        target = await asyncio.to_thread(checkpoint_for, store, pool, version)
    except WeightStoreError:
        fallback = await asyncio.to_thread(fall_back, store, version)
        if fallback is None:
            raise
        version = fallback
        target = await asyncio.to_thread(checkpoint_for, store, pool, version)
    target = await asyncio.to_thread(startup_checkpoint, store, pool, version, target)
    point_current(output, target)
    return version, target


def current_is_gone(output: Path) -> bool:
    """Whether ``output/current`` names a checkpoint that is no longer there (a version the trainer
    removed on resuming, or prune removed): an engine (re)started from it cannot load."""
    link = output / "current"
    return link.is_symlink() and not (link / MANIFEST).is_file()


UNLABELLED_VERSION = 0
"""What :meth:`EngineClient.get_weight_version` reads from an engine started without a version
(SGLang's ``default``); also the first version's number, hence :class:`Loaded`."""

LOADED_FILE = "loaded"
"""Beside the readiness gate's file: what the engine holds (:class:`Loaded`, as JSON)."""


@dataclass(frozen=True)
class Loaded:
    """A version as the store had it: its number and its manifest's sha256.  The number alone
    cannot tell a version from the one a resumed trainer publishes under the same number, nor
    version 0 from an unlabelled engine."""

    version: int
    manifest_sha256: str


def identity_of(store: WeightStore, version: int) -> Loaded | None:
    """``version`` as the store has it now, or None when it is not there."""
    digest = store.manifest_sha256(version)
    return None if digest is None else Loaded(version, digest)


def latest_identity(store: WeightStore) -> Loaded | None:
    """The store's latest version as it is now, or None while there is none."""
    while (latest := store.latest()) is not None:
        found = identity_of(store, latest)
        if found is not None:
            return found
        # removed between the listing and the read (a resumed trainer): list again
    return None


def record_loaded(output: Path, loaded: Loaded | None) -> None:
    """Write ``output/loaded`` (atomically); None removes it (nothing known)."""
    path = output / LOADED_FILE
    if loaded is None:
        path.unlink(missing_ok=True)
        return
    output.mkdir(parents=True, exist_ok=True)
    staged = output / f".{LOADED_FILE}.{os.getpid()}"
    staged.write_text(json.dumps({"version": loaded.version, "manifest_sha256": loaded.manifest_sha256}))
    os.replace(staged, path)


def read_loaded(output: Path) -> Loaded | None:
    """What ``output/loaded`` records, or None when it is missing or unreadable (then the engine
    is reloaded once rather than trusted)."""
    try:
        payload = json.loads((output / LOADED_FILE).read_text())
        version, digest = payload["version"], payload["manifest_sha256"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if isinstance(version, bool) or not isinstance(version, int) or not isinstance(digest, str):
        return None
    return Loaded(version, digest)


POLL_S = 2.0
"""How often a settled sidecar checks the weight store for a new version (``--poll``'s default):
a listing of one directory, cheap even on a shared filesystem; it bounds the wait between a publish
and the start of each engine's update (the engine then prepares the version while it decodes)."""

UNSETTLED_POLL_S = 0.5
"""How often the sidecar looks at an engine that is not up or not labelled yet (cheap: loopback)."""

PAUSE_MODE = "in_place"
"""Running requests stay where they are (their KV, their place in the batch) during the update."""
FLUSH_CACHE = False
"""SGLang refuses a flush while requests run after an in-place pause; see the module's docstring."""


async def update_paused(engine: EngineClient, target: str, version: int) -> dict:
    """SGLang's best disk path: an in-place pause for exactly the load.  Unpaused, SGLang's update
    takes its model-update lock as a writer and so waits until every running request has finished
    (a drained engine); paused in place, it loads at once and the sessions continue afterwards."""
    await engine.pause_generation(PAUSE_MODE)
    try:
        return await engine.update_weights_from_disk(
            target, version, abort_all_requests=False, flush_cache=FLUSH_CACHE
        )
    finally:
        await engine.continue_generation()


def serves_current(output: Path, target: str) -> bool:
    """Whether ``output/current`` already names ``target`` (the checkpoint an engine started from)."""
    link = output / "current"
    return link.is_symlink() and os.path.realpath(link) == os.path.realpath(target)


async def sync_engine(
    store: WeightStore,
    pool: ResolvedPool,
    output: Path,
    engine: EngineClient,
    version: int,
    served: int,
    holds: Loaded | None = None,
) -> Loaded:
    """Move one engine from ``served`` to ``version`` without dropping its sessions; returns what
    it holds now (also recorded in ``output/loaded``).

    ``holds``: what the engine holds as far as the sidecar knows (None: unknown).  An unlabelled
    engine that holds ``version`` as the store has it now, started from ``current`` naming its
    checkpoint, is labelled rather than reloaded; any other is reloaded."""
    # Read before the load: a republish after it leaves a digest that no longer matches the
    # store's, so the next look reloads; read after, it could record weights the engine lacks.
    want = await asyncio.to_thread(identity_of, store, version)
    if want is None:
        raise WeightStoreError(f"{store.path(version)}: version {version} is no longer in the store")
    target = await asyncio.to_thread(checkpoint_for, store, pool, version)
    # Across nodes, each member's init container picked the latest version on its own, and a
    # publish in between leaves them on different versions: only a load makes them all one.
    one_node = pool.nodes_per_replica == 1
    if served == UNLABELLED_VERSION and one_node and holds == want and serves_current(output, target):
        await engine.update_weight_version(version, abort_all_requests=False)
        record_loaded(output, want)
        log.info("pool %s engine started from version %d: labelled, not reloaded", pool.name, version)
        return want
    if pool.engine == "sglang":
        answer = await update_paused(engine, target, version)
    else:  # the torch engine prepares the version while it decodes and swaps between two steps
        answer = await engine.update_weights_from_disk(
            target, version, abort_all_requests=False, flush_cache=FLUSH_CACHE
        )
    if not answer.get("success"):
        raise SyncError(f"engine refused version {version} ({target}): {answer.get('message', '')}")
    point_current(output, await asyncio.to_thread(startup_checkpoint, store, pool, version, target))
    record_loaded(output, want)
    log.info("pool %s engine now serves version %d", pool.name, version)
    return want


@dataclass
class Broken:
    """The store's latest version when its chain is broken (None: it went meanwhile), and the
    version served instead.  By identity: a good version republished under the same number is
    not the broken one."""

    latest: Loaded | None
    fallback: int


async def sync_or_fall_back(
    store: WeightStore,
    pool: ResolvedPool,
    output: Path,
    engine: EngineClient,
    target: int,
    served: int,
    holds: Loaded | None = None,
) -> tuple[Broken | None, Loaded]:
    """Sync the engine to ``target``; when that fails because ``target``'s chain in the store is
    broken (or it was removed), sync it to the newest version that loads instead and say so.
    Returns that (None: ``target`` is served) and what the engine holds now."""
    wanted = await asyncio.to_thread(identity_of, store, target)
    try:
        return None, await sync_engine(store, pool, output, engine, target, served, holds)
    except (SyncError, WeightStoreError):
        fallback = await asyncio.to_thread(fall_back, store, target)
        if fallback is None:
            raise
    # The engine may hold the fallback's number with other weights (republished): same check as
    # for the latest version, by identity.
    if served != fallback or holds is None or holds != await asyncio.to_thread(identity_of, store, fallback):
        holds = await sync_engine(store, pool, output, engine, fallback, served, holds)
    return Broken(wanted, fallback), holds


async def follow(
    store: WeightStore,
    pool: ResolvedPool,
    output: Path,
    engine: EngineClient,
    poll_s: float,
    stop: asyncio.Event,
) -> None:
    """Until ``stop``: whenever the store's latest version is not the engine's, sync the engine.

    Not the engine's: another number, or the same number with another manifest (:class:`Loaded`).
    ``!=`` rather than ``>``: a trainer that resumes from an older checkpoint removes the newer
    versions and publishes their numbers again, and the engines must follow it back.  Until the engine is up and labelled it is
    checked every :data:`UNSETTLED_POLL_S` rather than every ``poll_s``: an engine that has just
    (re)started reports SGLang's ``default`` for the tokens it serves until it is labelled.  A
    latest version found broken is not tried again; its fallback is served until a newer one comes.

    A ``current`` that names a removed version is re-linked to the newest version that loads at
    once, whether the engine is up or not: an engine container restarted from it could not load,
    and would never come up for the sidecar to sync (a crash loop).  What the engine holds is left as it
    was (the gone version), so an unlabelled engine is then reloaded rather than labelled: it may
    have started from what ``current`` named before."""
    broken: Broken | None = None
    # What the engine holds: what this sidecar (or, before it, the init container or a sidecar
    # before a restart) last loaded or labelled it with.
    loaded = await asyncio.to_thread(read_loaded, output)
    while not stop.is_set():
        settled = labelled = False
        try:
            newest = await asyncio.to_thread(latest_identity, store)
            latest = None if newest is None else newest.version
            settled = latest is None  # nothing to serve yet: the store is checked every poll_s
            if broken is not None and broken.latest != newest:
                broken = None
            if latest is not None and await asyncio.to_thread(current_is_gone, output):
                gone = os.readlink(output / "current")
                version, checkpoint = await link_loadable(store, pool, output, latest)
                log.warning(
                    "pool %s: current named %s, which is gone; now version %d: %s",
                    pool.name,
                    gone,
                    version,
                    checkpoint,
                )
            if newest is not None and await engine.health():
                want: Loaded | None = newest
                if broken is not None:
                    want = await asyncio.to_thread(identity_of, store, broken.fallback)
                if want is None:  # the fallback went since: try the latest again
                    broken, want = None, newest
                served = await engine.get_weight_version()
                # An engine labelled with the recorded version holds it; so does an unlabelled one
                # (restarted from `current`, which moves with the record) unless `current` was
                # re-linked since, and then the record names a version that is gone.
                known = loaded is not None and served in (loaded.version, UNLABELLED_VERSION)
                holds = loaded if known else None
                if served != want.version or holds != want:
                    outcome, loaded = await sync_or_fall_back(
                        store, pool, output, engine, want.version, served, holds
                    )
                    if outcome is not None:  # about the store's latest version, not a fallback
                        broken = Broken(newest if broken is None else broken.latest, outcome.fallback)
                    served = loaded.version
                # Labelled now: by this sidecar, or with the version it holds (0 reads as both
                # `default` and version 0, and the engine holds version 0 as the store has it).
                # An older version than the latest still labels its tokens truly: only an
                # unlabelled engine (just restarted) is kept out of service.
                settled = labelled = True
            mark_labelled(output, served if labelled else None)
        except EngineError as exc:
            if exc.status == 401:
                raise SyncError(f"the engine refused the token: {exc}") from None
            log.warning("weight sync of pool %s: %s (retrying)", pool.name, exc)
        except (SyncError, WeightStoreError, OSError) as exc:
            log.warning("weight sync of pool %s: %s (retrying)", pool.name, exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=poll_s if settled else min(poll_s, UNSETTLED_POLL_S))


def mark_labelled(output: Path, version: int | None) -> None:
    """The readiness gate's file (:data:`mixrl.api.launch.LABELLED_FILE`): the version the engine
    labels its tokens with, or no file while it is down or unlabelled."""
    path = output / LABELLED_FILE
    if version is None:
        path.unlink(missing_ok=True)
    elif not path.exists() or path.read_text() != str(version):
        staged = path.with_suffix(".tmp")
        staged.write_text(str(version))
        staged.replace(path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mixrl engine-sync", description="Keep one engine on the run's latest weight version."
    )
    parser.add_argument("--config", required=True, type=Path, help="resolved run JSON (the run's ConfigMap)")
    parser.add_argument("--pool", required=True, help="this engine's pool (samplerPools[].name)")
    parser.add_argument("--output", required=True, type=Path, help="directory for the `current` link")
    parser.add_argument("--once", action="store_true", help="prepare the starting checkpoint and exit")
    parser.add_argument(
        "--engine-url", default=f"http://127.0.0.1:{ENGINE_PORT}", help="the engine in this pod"
    )
    parser.add_argument("--poll", type=float, default=POLL_S, help="seconds between store checks")
    parser.add_argument(
        "--timeout", type=float, default=0.0, help="--once: give up after this many seconds (0: never)"
    )
    add_auth_arguments(parser)
    return parser


def load_pool(config: Path, name: str) -> tuple[ResolvedRun, ResolvedPool]:
    try:
        run = load_resolved(config)
    except RunConfigError as exc:
        raise SyncError(str(exc)) from None
    try:
        return run, run.pool(name)
    except KeyError:
        known = ", ".join(p.name for p in run.pools)
        raise SyncError(f"--pool: no pool named {name!r} in run {run.name!r} (pools: {known})") from None


async def run_sidecar(args: argparse.Namespace) -> int:
    run, pool = load_pool(args.config, args.pool)
    store = WeightStore(run.weights.store)
    if args.once:
        await prepare(store, pool, args.output, args.poll, args.timeout)
        return 0
    try:
        auth_token = token_from_args(args)
    except AuthConfigError as exc:
        raise SyncError(str(exc)) from None
    stop = asyncio.Event()
    stop_on_signals(stop)
    async with EngineClient(args.engine_url, timeout_s=600.0, auth_token=auth_token) as engine:
        await follow(store, pool, args.output, engine, args.poll, stop)
    return 0


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.poll <= 0:
        print("mixrl engine-sync: --poll: must be positive", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-sync %(message)s")
    try:
        return asyncio.run(run_sidecar(args))
    except SyncError as exc:
        print(f"mixrl engine-sync: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
