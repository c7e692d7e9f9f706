"""The router's bookkeeping: pools, replicas, sessions and load (pure: no I/O, time is passed in).

A session is bound to one pool and to one replica while that replica is ready, so the replica's
prefix cache keeps the conversation.  New sessions go to the pool chosen by the
:class:`~mixrl.rl.router.shares.ShareScheduler` and, inside it, to the least-loaded ready
replica.  A session leaves its pool when the pool has no ready replica, or when the pool lost
ready capacity and holds far more than its share of the live sessions
(:func:`~mixrl.rl.router.shares.keeps_draining`): then its sessions move, at their next
request, to the pool furthest below its share, until it is back near its own.  The HTTP layer (``server.py``) calls :meth:`RouterState.route` before each request and
:meth:`begin` / :meth:`finish` around it.

A request may demand a minimum weight version (docs/router.md#version-aware-routing): it then goes
only to a ready replica known to serve that version or a newer one.  A session whose replica is
older moves to one that is not (its own pool first); when no ready replica serves it,
:class:`VersionUnavailable` leaves the session where it is and the request is answered 409.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from mixrl.rl.engine.version_gate import satisfies
from mixrl.rl.health.routing import (
    HEALTHY,
    HealthPolicy,
    MismatchReport,
    PoolHealth,
    health_weighted_shares,
    observe_all,
)
from mixrl.rl.router.config import PoolConfig
from mixrl.rl.router.shares import (
    REBALANCE_STOP,
    PeakThroughput,
    PoolCapacity,
    ShareScheduler,
    balanced_after_refresh,
    capacity_choices,
    capacity_per_replica,
    drain_step,
    rebalance_destination,
    reported_measurements,
    target_shares,
)


class NoReadyReplica(Exception):
    """No pool has a ready replica: the request cannot be placed now (retry later)."""


class VersionUnavailable(Exception):
    """Replicas are ready, but none is known to serve the request's minimum weight version (retry
    once the weights have reached them); ``newest``: the newest version a ready replica serves."""

    def __init__(self, minimum: int, newest: int | None) -> None:
        shown = "none is known" if newest is None else f"the newest is {newest}"
        super().__init__(f"no ready replica serves weight version {minimum} or newer ({shown})")
        self.minimum = minimum
        self.newest = newest


class UnknownPool(KeyError):
    pass


@dataclass
class Replica:
    url: str
    ready: bool = False
    in_flight: int = 0
    """Requests forwarded to the replica and not yet answered."""
    waiting: int = 0
    """Requests held by the router because the replica is at its in-flight limit."""
    sessions: int = 0
    """Live sessions bound to this replica."""
    generated_tokens: int = 0
    throughput: PeakThroughput = field(default_factory=PeakThroughput)
    at_capacity: PeakThroughput = field(default_factory=PeakThroughput)
    """Its samples taken while it had requests queued (router or engine): only a replica kept full
    shows what it can do, so only these may overrule a declared capacity (a pool the router gave
    few sessions would otherwise look slow, get fewer still, and never recover)."""
    weight_version: int | None = None
    """The version it serves, as last heard: its ``/get_weight_version`` at each health probe, the
    newest version in its answers, the version its 409s name (None: not known yet)."""

    def serves(self, minimum: int | None) -> bool:
        """Ready, and known to serve ``minimum`` or newer (any ready replica when None)."""
        return self.ready and satisfies(self.weight_version, minimum)


@dataclass
class Pool:
    name: str
    gpu_type: str
    precision: str
    capacity: float | None
    replicas: dict[str, Replica] = field(default_factory=dict)
    sessions_assigned: int = 0
    """Sessions given to this pool so far (new ones and ones moved here from another pool)."""
    sessions_moved_out: int = 0
    """Sessions that left this pool for another (no ready replica here, or rebalanced)."""
    sessions_rebalanced_out: int = 0
    """Of those, the ones moved because the pool lost capacity and held too many (while it had
    a ready replica)."""
    draining: bool = False
    """Shedding sessions now (:func:`~mixrl.rl.router.shares.keeps_draining`)."""
    ready_count: int = 0
    """Ready replicas, as of the last share refresh."""
    balanced_count: int = 0
    """Its ready replicas when it last held no more than its share of the sessions (raised with
    every rise): below it, the pool has lost replicas since (the rule:
    :func:`~mixrl.rl.router.shares.balanced_after_refresh`, :func:`~mixrl.rl.router.shares.drain_step`).
    Counted in replicas, not capacity: a measured capacity's wobble, or a capacity set lower, is no
    loss of nodes."""
    departed_in_flight: dict[str, int] = field(default_factory=dict)
    """Requests still in flight to replicas taken off the list (by URL): a replica that comes back
    (DNS lists a pod again once it passes its readiness check) starts with them, so its count
    never goes below zero when they end."""
    replica_failures: int = 0
    """Times a replica of this pool was found unreachable by a request."""
    requests: int = 0
    """Requests forwarded here that ended with a status: the replica's (any), or the router's 504
    (no answer in time) or 499 (the client went away first); ``mixrl_router_requests_total``."""
    errors: int = 0
    """Requests forwarded here that failed: replica unreachable, an error status (≥ 400) from the
    engine, 504 or 499; ``mixrl_router_errors_total``."""
    generated_tokens: int = 0
    weight_version: int | None = None
    """The newest weight version in this pool's answers (None until one names its version)."""
    gpus_per_replica: int = 0
    price_per_gpu_hour: float = 0.0
    cost_dollars: float = 0.0
    """GPU cost of the replicas the router has known, accrued at each monitoring round."""

    def ready_replicas(self) -> list[Replica]:
        return [replica for replica in self.replicas.values() if replica.ready]

    def serving(self, minimum: int | None) -> list[Replica]:
        """Its ready replicas that serve ``minimum`` or newer."""
        return [replica for replica in self.replicas.values() if replica.serves(minimum)]

    def measured_capacity(self) -> float | None:
        """Mean recent-peak throughput of the ready replicas that have been measured."""
        estimates = [r.throughput.estimate() for r in self.ready_replicas()]
        measured = [e for e in estimates if e is not None]
        return sum(measured) / len(measured) if measured else None

    def measured_at_capacity(self) -> tuple[float | None, int]:
        """Mean recent-peak throughput of its ready replicas while they had requests queued, and the
        samples behind it (its trust: shares.MIN_CAPACITY_SAMPLES)."""
        ready = self.ready_replicas()
        estimates = [e for e in (r.at_capacity.estimate() for r in ready) if e is not None]
        mean = sum(estimates) / len(estimates) if estimates else None
        return mean, sum(len(r.at_capacity) for r in ready)

    def capacity_view(self) -> PoolCapacity:
        """What its share depends on: a declared pool's measurement is its full replicas' (only
        that may overrule the declaration); a null pool's is every sample's recent peak."""
        ready = len(self.ready_replicas())
        if self.capacity is None:
            samples = sum(len(r.throughput) for r in self.ready_replicas())
            return PoolCapacity(None, self.measured_capacity(), ready, samples)
        measured, samples = self.measured_at_capacity()
        return PoolCapacity(self.capacity, measured, ready, samples)


@dataclass
class Session:
    id: str
    pool: str
    replica: str | None
    last_seen: float
    """When its last request ended (or its latest one was routed): its idle clock."""
    in_flight: int = 0
    """Its requests routed and not yet ended: while any runs, it is not idle and never expires
    (a turn may outlast the TTL, and its next turn must find its replica)."""


@dataclass(frozen=True)
class Route:
    pool: str
    replica: str
    session: str | None
    moved: bool = False
    """The session had to leave its replica (or pool) because that one is gone or down."""


class RouterState:
    def __init__(self, pools: Iterable[PoolConfig], session_ttl: float = 900.0) -> None:
        self.pools: dict[str, Pool] = {}
        for config in pools:
            pool = Pool(config.name, config.gpu_type, config.precision, config.capacity)
            pool.replicas = {url: Replica(url) for url in config.replicas}
            pool.gpus_per_replica, pool.price_per_gpu_hour = (
                config.gpus_per_replica,
                config.price_per_gpu_hour,
            )
            self.pools[config.name] = pool
        if not self.pools:
            raise ValueError("the router needs at least one pool")
        self.session_ttl = session_ttl
        self.sessions: dict[str, Session] = {}
        self.held: dict[str, int] = dict.fromkeys(self.pools, 0)
        """Live sessions bound to each pool (kept as sessions come, move and go)."""
        self.scheduler = ShareScheduler()
        self.health: dict[str, PoolHealth] = {}
        """Each pool's health from the trainer's fresh mismatch (empty: routing by capacity alone)."""
        self.mismatch_step: int | None = None
        self.version_refusals = 0
        """Requests ``POST /generate`` answered 409 for their minimum weight version (the router's
        own refusals and a replica's passed on); counted by the server, which answers them."""
        """Requests answered 409: no ready replica served their minimum weight version."""
        self.refresh_shares()

    # ----------------------------------------------------------------- pools and replicas

    def pool(self, name: str) -> Pool:
        try:
            return self.pools[name]
        except KeyError:
            raise UnknownPool(name) from None

    def replica(self, pool: str, url: str) -> Replica | None:
        return self.pool(pool).replicas.get(url)

    def set_replicas(self, pool_name: str, urls: Iterable[str]) -> list[str]:
        """Replace a pool's replica list; returns the URLs that are new (not ready until checked).

        Replicas that stay keep their state; sessions on a removed replica stay on the pool and
        move to another replica at their next request.
        """
        pool = self.pool(pool_name)
        wanted = list(dict.fromkeys(url.rstrip("/") for url in urls))  # a URL listed twice is one replica
        added = [url for url in wanted if url not in pool.replicas]
        removed = [url for url in pool.replicas if url not in wanted]
        for url in removed:
            gone = pool.replicas.pop(url)
            if gone.in_flight > 0:
                pool.departed_in_flight[url] = gone.in_flight
        for session in self.sessions.values():
            if session.pool == pool_name and session.replica in removed:
                session.replica = None
        pool.replicas = {
            url: pool.replicas.get(url) or Replica(url, in_flight=pool.departed_in_flight.pop(url, 0))
            for url in wanted
        }
        self.refresh_shares()
        return added

    def set_capacity(self, pool_name: str, capacity: float | None) -> None:
        if capacity is not None and capacity <= 0:
            raise ValueError(f"capacity of pool {pool_name!r} must be > 0 (or null = measured)")
        self.pool(pool_name).capacity = capacity
        self.refresh_shares()

    def set_ready(self, pool_name: str, url: str, ready: bool) -> None:
        replica = self.replica(pool_name, url)
        if replica is None or replica.ready == ready:
            return
        replica.ready = ready
        self.refresh_shares()

    def set_version(self, pool_name: str, url: str, version: int | None) -> None:
        """What a replica serves now, as just heard from it (None: nothing heard; kept as it was)."""
        replica = self.replica(pool_name, url)
        if replica is not None and version is not None:
            replica.weight_version = version

    def newest_ready_version(self) -> int | None:
        """The newest weight version a ready replica is known to serve (None: none known)."""
        versions = [
            r.weight_version
            for pool in self.pools.values()
            for r in pool.ready_replicas()
            if r.weight_version is not None
        ]
        return max(versions) if versions else None

    def mark_down(self, pool_name: str, url: str) -> None:
        """A request to the replica failed at the connection: stop sending it work until it is healthy."""
        replica = self.replica(pool_name, url)
        if replica is not None and replica.ready:
            self.pool(pool_name).replica_failures += 1
        self.set_ready(pool_name, url, False)

    def record_throughput(
        self, pool_name: str, url: str, tokens_per_second: float, queued: bool = False
    ) -> None:
        """One throughput sample of a replica; ``queued``: it had requests waiting (router or
        engine), so it ran at what it can do."""
        replica = self.replica(pool_name, url)
        if replica is None:
            return
        before = capacity_per_replica(self.capacities())
        replica.throughput.add(tokens_per_second)
        if queued or replica.waiting:
            replica.at_capacity.add(tokens_per_second)
        if capacity_per_replica(self.capacities()) != before:
            self.refresh_shares()

    def capacities(self) -> dict[str, PoolCapacity]:
        return {name: pool.capacity_view() for name, pool in self.pools.items()}

    def accrue_cost(self, seconds: float) -> None:
        """Every pool's replicas (the ones the router knows: pods with an address, ready or not)
        held for ``seconds`` more, at their price."""
        for pool in self.pools.values():
            gpus = len(pool.replicas) * pool.gpus_per_replica
            pool.cost_dollars += gpus * pool.price_per_gpu_hour * max(seconds, 0.0) / 3600

    def refresh_shares(self) -> None:
        capacities = self.capacities()
        for name, pool in self.pools.items():
            pool.ready_count = capacities[name].ready_replicas
            pool.balanced_count = balanced_after_refresh(pool.balanced_count, pool.ready_count)
        shares = target_shares(capacities)
        if self.health:  # mismatch-aware routing: capacity × health (mixrl.rl.health.routing)
            shares = health_weighted_shares(shares, self.health)
        self.scheduler.set_shares(shares)

    def observe_mismatch(self, report: MismatchReport, policy: HealthPolicy) -> bool:
        """One trainer step's fresh mismatch: every pool's health moves (a pool absent from the
        report holds), and the shares follow.  Only a newer step counts; returns whether it did."""
        if self.mismatch_step is not None and report.step <= self.mismatch_step:
            return False
        self.mismatch_step = report.step
        observations = {name: obs for name, obs in report.observations().items() if name in self.pools}
        states = {name: self.health.get(name, HEALTHY) for name in self.pools}
        self.health = observe_all(states, observations, policy)
        self.refresh_shares()
        return True

    # ----------------------------------------------------------------- sessions

    def route(self, session_id: str | None, now: float, min_version: int | None = None) -> Route:
        """Where the next request of a session goes; binds new sessions.  Raises NoReadyReplica,
        or VersionUnavailable when replicas are ready but none serves ``min_version`` or newer."""
        if session_id is None:
            pool_name = self._assign_pool(min_version)
            return Route(pool_name, self._least_loaded(pool_name, min_version).url, None)
        session = self.sessions.get(session_id)
        if session is None:
            pool_name = self._assign_pool(min_version)
            replica = self._least_loaded(pool_name, min_version)
            replica.sessions += 1
            self.sessions[session_id] = Session(session_id, pool_name, replica.url, now)
            self.held[pool_name] += 1
            return Route(pool_name, replica.url, session_id)
        session.last_seen = now
        pool = self.pools[session.pool]
        current = pool.replicas.get(session.replica) if session.replica else None
        live = current is not None and current.ready
        if current is not None and live and not current.serves(min_version):
            return self._move_to_version(session, min_version)
        destination = self._shed_to(pool, live, min_version) if pool.ready_replicas() else None
        if destination is None and current is not None and live:
            return Route(pool.name, current.url, session_id)
        # Its replica is gone or down, or its pool sheds sessions: another replica of the same
        # pool, else another pool.
        self._unbind(session)
        if destination is not None:
            self._rehome(session, destination)
            self.pools[destination].sessions_assigned += 1
            pool.sessions_rebalanced_out += 1
        elif not pool.serving(min_version):
            # raises when no pool can take it: it waits
            self._rehome(session, self._assign_pool(min_version))
        return self._bind(session, min_version)

    def _move_to_version(self, session: Session, min_version: int | None) -> Route:
        """A live session whose replica is older than the request's minimum: to a replica that
        serves it, of its own pool if one does (decided before anything changes, so a session
        that cannot move keeps its replica and its prefix cache)."""
        pool = self.pools[session.pool]
        target = pool.name if pool.serving(min_version) else self._assign_pool(min_version)
        self._unbind(session)
        if target != pool.name:
            self._rehome(session, target)
        return self._bind(session, min_version)

    def _bind(self, session: Session, min_version: int | None) -> Route:
        """Bind an unbound session to the least-loaded replica of its pool that serves ``min_version``."""
        replica = self._least_loaded(session.pool, min_version)
        replica.sessions += 1
        session.replica = replica.url
        return Route(session.pool, replica.url, session.id, moved=True)

    def end_session(self, session_id: str) -> bool:
        session = self.sessions.pop(session_id, None)
        if session is None:
            return False
        self._unbind(session)
        self.held[session.pool] -= 1
        return True

    def _shed_to(self, pool: Pool, live: bool, min_version: int | None = None) -> str | None:
        """Where a session of ``pool`` moves now if the pool sheds sessions (None: it stays).

        ``live``: the session's replica is ready (it has a prefix cache to lose).  Sessions whose
        replica is gone or down lose theirs anyway, so they go first: a live one moves only while
        the pool's sessions on ready replicas alone are above the stopping mark."""
        total = sum(self.held.values())
        share = self.scheduler.shares.get(pool.name, 0.0)
        fair = share * total
        held = self.held[pool.name]
        pool.draining, pool.balanced_count = drain_step(
            pool.draining, pool.balanced_count, pool.ready_count, held, fair
        )
        if not pool.draining:
            return None
        if live:
            bound = sum(r.sessions for r in pool.ready_replicas())
            if bound <= REBALANCE_STOP * fair:
                return None
        destination = rebalance_destination(self.held, self.scheduler.shares, pool.name)
        if destination is None or not self.pools[destination].serving(min_version):
            return None
        return destination

    def _rehome(self, session: Session, pool_name: str) -> None:
        """Move an unbound session to another pool."""
        self.pools[session.pool].sessions_moved_out += 1
        self.held[session.pool] -= 1
        self.held[pool_name] += 1
        session.pool = pool_name

    def hold(self, session_id: str | None) -> Session | None:
        """A request of the session (routed already) starts: the session does not expire until
        :meth:`release`.  The session itself is returned, so the release reaches it even if the
        session was ended and a new one of the same name began meanwhile."""
        session = self.sessions.get(session_id) if session_id is not None else None
        if session is not None:
            session.in_flight += 1
        return session

    def release(self, session: Session | None, now: float) -> None:
        """A request held by :meth:`hold` ended: the session's idle clock starts now."""
        if session is not None:
            session.in_flight -= 1
            session.last_seen = now

    def expire_sessions(self, now: float) -> list[str]:
        """Forget sessions idle for longer than the TTL (their rollout worker is gone); a session
        with a request in flight is not idle, however long that request runs."""
        expired = [
            s.id for s in self.sessions.values() if s.in_flight == 0 and now - s.last_seen > self.session_ttl
        ]
        for session_id in expired:
            self.end_session(session_id)
        return expired

    def _unbind(self, session: Session) -> None:
        replica = self.pools[session.pool].replicas.get(session.replica) if session.replica else None
        if replica is not None:
            replica.sessions -= 1
        session.replica = None

    def _assign_pool(self, min_version: int | None = None) -> str:
        """The pool for a session by the shares, among the pools serving ``min_version``."""
        among = None
        if min_version is not None and any(p.ready_replicas() for p in self.pools.values()):
            among = [name for name, p in self.pools.items() if p.serving(min_version)]
            if not among:
                raise VersionUnavailable(min_version, self.newest_ready_version())
        pool = self.scheduler.next_pool(among)
        if pool is None and among:  # the serving pools have no share (health): still the only ones
            pool = among[0]
        if pool is None:
            raise NoReadyReplica("no sampler pool has a ready replica")
        self.pools[pool].sessions_assigned += 1
        return pool

    def _least_loaded(self, pool_name: str, min_version: int | None = None) -> Replica:
        """The ready replica (serving ``min_version``) with the fewest requests in flight or
        waiting, then fewest sessions."""
        ready = self.pools[pool_name].serving(min_version)
        if not ready:
            raise NoReadyReplica(f"pool {pool_name!r} has no ready replica")
        return min(ready, key=lambda r: (r.in_flight + r.waiting, r.sessions))

    # ----------------------------------------------------------------- requests

    def begin(self, pool: str, url: str) -> None:
        replica = self.replica(pool, url)
        if replica is not None:
            replica.in_flight += 1

    def finish(
        self,
        pool: str,
        url: str,
        generated_tokens: int = 0,
        status: int | None = 200,
        weight_version: int | None = None,
    ) -> None:
        """A forwarded request ended with an HTTP status, or None when the replica was unreachable;
        ``weight_version``: the newest version its answer names."""
        the_pool = self.pool(pool)
        the_pool.generated_tokens += generated_tokens
        if weight_version is not None:
            the_pool.weight_version = max(weight_version, the_pool.weight_version or 0)
            self.set_version(pool, url, weight_version)
        if status is not None:
            the_pool.requests += 1
        if status is None or status >= 400:
            the_pool.errors += 1
        replica = the_pool.replicas.get(url)
        if replica is not None:
            replica.in_flight -= 1
            replica.generated_tokens += generated_tokens
        elif url in the_pool.departed_in_flight:  # taken off the list while this request ran
            the_pool.departed_in_flight[url] -= 1
            if the_pool.departed_in_flight[url] <= 0:
                del the_pool.departed_in_flight[url]

    # ----------------------------------------------------------------- views

    def active_sessions(self) -> dict[str, int]:
        return dict(self.held)

    def snapshot(self) -> dict[str, object]:
        """What ``GET /pools`` shows."""
        shares = self.scheduler.shares
        capacities = self.capacities()
        choices = capacity_choices(capacities)
        measured = reported_measurements(capacities)
        active = self.active_sessions()
        total_active = sum(active.values())
        total_assigned = sum(pool.sessions_assigned for pool in self.pools.values())
        pools = []
        for name, pool in self.pools.items():
            pools.append(
                {
                    "name": name,
                    "gpu_type": pool.gpu_type,
                    "precision": pool.precision,
                    "capacity": pool.capacity,
                    "capacity_source": choices[name][1],
                    "capacity_per_replica": choices[name][0],
                    "capacity_measured": measured.get(name),
                    "ready_replicas": len(pool.ready_replicas()),
                    "target_share": shares.get(name, 0.0),
                    "active_sessions": active[name],
                    "active_session_share": active[name] / total_active if total_active else 0.0,
                    "sessions_assigned": pool.sessions_assigned,
                    "assigned_share": pool.sessions_assigned / total_assigned if total_assigned else 0.0,
                    "in_flight": sum(r.in_flight for r in pool.replicas.values()),
                    "queue_depth": sum(r.waiting for r in pool.replicas.values()),
                    "generated_tokens": pool.generated_tokens,
                    "health": self.health.get(name, HEALTHY).health,
                    "requests": pool.requests,
                    "errors": pool.errors,
                    "replica_failures": pool.replica_failures,
                    "sessions_moved_out": pool.sessions_moved_out,
                    "sessions_rebalanced_out": pool.sessions_rebalanced_out,
                    "draining": pool.draining,
                    "replicas": [
                        {
                            "url": r.url,
                            "ready": r.ready,
                            "in_flight": r.in_flight,
                            "waiting": r.waiting,
                            "sessions": r.sessions,
                            "generated_tokens": r.generated_tokens,
                            "measured_throughput": r.throughput.estimate(),
                            "weight_version": r.weight_version,
                        }
                        for r in pool.replicas.values()
                    ],
                }
            )
        return {"pools": pools, "sessions": total_active, "version_refusals": self.version_refusals}
