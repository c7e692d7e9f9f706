"""The test bed's network for real nodes: only interfaces the bed makes, nothing routed off the machine.

Layout (pure values below; ``Network.up``/``down`` run the ``ip``/``nsenter``/``nft`` commands):

- a bridge ``mixrl-br0`` on the host with ``10.250.0.1/24``: the API server and CoreDNS listen on
  that address (not on every interface);
- real node ``i`` lives in its own network namespace ``mixrl-node-<i>``, joined to the bridge by a
  veth pair, at ``10.250.0.<10+i>``, default route via the bridge;
- its pods get ``10.245.<i>.0/24`` from the CNI bridge plugin inside that namespace; the host routes
  that subnet to the node.

Forwarding: each node's namespace forwards between its pods and the bridge (its own
``ip_forward``, which does not touch the host's). The host forwards only when there are two or more
nodes (pod to pod across nodes); whenever real nodes run, an nftables table of the bed's own drops
every packet forwarded from or onto the bed's interfaces from or to outside the bed's subnets, so
nothing of the bed reaches another interface even where the host already forwards, and the host's
own forwarding is left alone; where the host forwarded nothing before, it forwards nothing but the
bed's (:func:`nft_confinement`).  ``down`` removes the namespaces, the bridge, the routes and the
table, and puts the host's ``ip_forward`` back as it found it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

INTERFACE_PREFIX = "mixrl-"
"""Every host interface the bed makes (the bridge, the nodes' host-side veths) starts with it."""
BRIDGE = f"{INTERFACE_PREFIX}br0"
BED_SUBNET = ipaddress.ip_network("10.250.0.0/24")
HOST_IP = "10.250.0.1"
POD_SUPERNET = ipaddress.ip_network("10.245.0.0/16")
NFT_TABLE = "mixrl_bed"
NETNS_DIR = Path("/run/netns")


@dataclass(frozen=True)
class NodeAddress:
    index: int

    @property
    def name(self) -> str:
        return f"mixrl-node-{self.index}"

    @property
    def netns(self) -> str:
        return self.name

    @property
    def netns_path(self) -> Path:
        return NETNS_DIR / self.netns

    @property
    def host_veth(self) -> str:
        return f"{INTERFACE_PREFIX}n{self.index}h"

    @property
    def node_veth(self) -> str:
        return f"mixrl-n{self.index}"

    @property
    def ip(self) -> str:
        return str(BED_SUBNET.network_address + 10 + self.index)

    @property
    def pod_cidr(self) -> str:
        return str(ipaddress.ip_network(f"10.245.{self.index}.0/24"))

    def enter(self) -> list[str]:
        """The prefix that runs a command in the node's network namespace (and nothing else: the
        mounts, cgroups and /sys stay the host's, which `ip netns exec` would remount)."""
        return ["nsenter", f"--net={self.netns_path}", "--"]


def node_addresses(count: int) -> list[NodeAddress]:
    if not 0 <= count <= 200:
        raise ValueError("--real-nodes: between 0 and 200")
    return [NodeAddress(i) for i in range(count)]


def bed_subnets() -> list[str]:
    return [str(BED_SUBNET), str(POD_SUPERNET)]


def up_commands(nodes: list[NodeAddress]) -> list[list[str]]:
    """Every command that builds the network, in order (pure)."""
    commands = [
        ["ip", "link", "add", BRIDGE, "type", "bridge"],
        ["ip", "addr", "add", f"{HOST_IP}/{BED_SUBNET.prefixlen}", "dev", BRIDGE],
        ["ip", "link", "set", BRIDGE, "up"],
    ]
    for node in nodes:
        inside = node.enter()
        commands += [
            ["ip", "netns", "add", node.netns],
            ["ip", "link", "add", node.host_veth, "type", "veth", "peer", "name", node.node_veth],
            ["ip", "link", "set", node.host_veth, "master", BRIDGE, "up"],
            ["ip", "link", "set", node.node_veth, "netns", node.netns],
            [*inside, "ip", "link", "set", "lo", "up"],
            [*inside, "ip", "link", "set", node.node_veth, "name", "eth0"],
            [*inside, "ip", "addr", "add", f"{node.ip}/{BED_SUBNET.prefixlen}", "dev", "eth0"],
            [*inside, "ip", "link", "set", "eth0", "up"],
            [*inside, "ip", "route", "add", "default", "via", HOST_IP],
            # The node forwards between its pods and the bridge; kube-proxy's Service rules need
            # bridged pod traffic to pass netfilter, as on any node.
            [*inside, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"],
            [*inside, "sysctl", "-q", "-w", "net.bridge.bridge-nf-call-iptables=1"],
            ["ip", "route", "add", node.pod_cidr, "via", node.ip, "dev", BRIDGE],
        ]
    if nodes:
        commands.append(["nft", "-f", "-"])  # the forwarding confinement (its text: nft_confinement)
    return commands


def nft_confinement(host_forwarded: bool) -> str:
    """The bed's packets stay between the bed's subnets: what its interfaces forward must go to
    them, what is forwarded onto them must come from them, and none of it is IPv6.

    ``host_forwarded``: the host forwarded packets before the bed (a router, a container engine),
    whose own traffic is then left alone.  When it did not, and the bed turned forwarding on, every
    forwarded packet that is not the bed's is dropped too, so the host forwards nothing else."""
    subnets = f"{{ {', '.join(bed_subnets())} }}"
    ours = f'"{INTERFACE_PREFIX}*"'
    rules = [
        f"iifname {ours} ip daddr != {subnets} drop",
        f"oifname {ours} ip saddr != {subnets} drop",
        f"iifname {ours} meta nfproto ipv6 drop",
        f"oifname {ours} meta nfproto ipv6 drop",
    ]
    if not host_forwarded:
        rules += [f"ip saddr != {subnets} drop", f"ip daddr != {subnets} drop", "meta nfproto ipv6 drop"]
    return (
        f"table inet {NFT_TABLE} {{\n"
        "  chain forward {\n"
        "    type filter hook forward priority -10; policy accept;\n"
        + "".join(f"    {rule}\n" for rule in rules)
        + "  }\n"
        "}\n"
    )


@dataclass
class Network:
    """Builds and removes the bed's network; what it changed on the host is kept in ``state_file``
    so ``down`` undoes exactly that, even from another process."""

    state_file: Path

    def up(self, nodes: list[NodeAddress]) -> None:
        self.down()  # a bed killed without `down` leaves its interfaces; start clean
        state: dict = {"nodes": [n.index for n in nodes], "ip_forward": None}
        self.state_file.write_text(json.dumps(state))
        forwarding = Path("/proc/sys/net/ipv4/ip_forward")
        for command in up_commands(nodes):
            if command[:2] == ["nft", "-f"]:
                before = forwarding.read_text().strip()
                _run(command, input=nft_confinement(host_forwarded=before != "0"))
                if len(nodes) > 1:  # pod to pod across nodes goes through the host
                    state["ip_forward"] = before
                    self.state_file.write_text(json.dumps(state))
                    forwarding.write_text("1")
            else:
                _run(command)

    def down(self) -> None:
        try:
            state = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            state = {"nodes": [], "ip_forward": None}
        if state.get("ip_forward") is not None:
            with contextlib.suppress(OSError):
                Path("/proc/sys/net/ipv4/ip_forward").write_text(state["ip_forward"])
        _run(["nft", "delete", "table", "inet", NFT_TABLE], check=False)
        indices = set(state.get("nodes", [])) | {
            int(p.name.rsplit("-", 1)[1]) for p in _glob_netns() if p.name.rsplit("-", 1)[1].isdigit()
        }
        for index in sorted(indices):
            node = NodeAddress(index)
            _run(["ip", "route", "del", node.pod_cidr], check=False)
            _run(["ip", "link", "del", node.host_veth], check=False)
            _run(["ip", "netns", "del", node.netns], check=False)
        _run(["ip", "link", "del", BRIDGE], check=False)
        self.state_file.unlink(missing_ok=True)


def _glob_netns() -> list[Path]:
    return sorted(NETNS_DIR.glob("mixrl-node-*")) if NETNS_DIR.exists() else []


class NetworkError(RuntimeError):
    pass


def _run(command: list[str], input: str | None = None, check: bool = True) -> None:
    done = subprocess.run(command, input=input, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise NetworkError(f"{' '.join(command)}: {done.stderr.strip() or done.returncode}")
