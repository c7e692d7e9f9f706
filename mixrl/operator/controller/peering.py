"""Whether kopf's peering has paused this operator, judged from the peering object (pure).

kopf pauses its handlers while another live operator with the same peering name has a higher
priority, or the same one (then every operator of that priority pauses).  The built-in autoscaler is
a task of the operator process, not a kopf handler, so it asks the same question itself before each
round of polls, from the (Cluster)KopfPeering object's status, which kopf keeps as
``{identity: {"priority": int, "lifetime": seconds, "lastseen": ISO 8601}}``.

Our own identity is kopf's secret, so the rule is applied to the count: among the live peers, any
with a priority above ours, or two or more with ours (us and another), means kopf has paused us.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

DEFAULT_LIFETIME_S = 60
"""kopf's default when a peer does not say."""


@dataclass(frozen=True)
class Peer:
    priority: int
    deadline: datetime


def parse_peers(status: Mapping[str, Any]) -> list[Peer]:
    """The peers in a peering object's status; entries that are not kopf's are skipped."""
    peers = []
    for info in status.values():
        if not isinstance(info, Mapping):
            continue
        try:
            lastseen = datetime.fromisoformat(str(info["lastseen"]))
            lifetime = timedelta(seconds=int(info.get("lifetime", DEFAULT_LIFETIME_S)))
            priority = int(info.get("priority", 0))
        except (KeyError, TypeError, ValueError):
            continue
        if lastseen.tzinfo is None:
            lastseen = lastseen.replace(tzinfo=UTC)
        peers.append(Peer(priority, lastseen + lifetime))
    return peers


def paused_by_peers(status: Mapping[str, Any], priority: int, now: datetime) -> bool:
    """kopf's rule, from the outside: a live peer above ``priority``, or a second live one at it."""
    live = [peer for peer in parse_peers(status) if peer.deadline > now]
    return any(peer.priority > priority for peer in live) or (
        sum(1 for peer in live if peer.priority == priority) >= 2
    )
