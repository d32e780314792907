"""Network namespaces for fault injection (ops/faults/chaos.py): every NATS node and every service
instance in a namespace of its own, each joined to one bridge in this (the root) namespace by a
veth pair, so a partition, a cut or a slow link hits one process's network and nothing else.

    with Namespaces.create() as net:           # needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN)
        Stack(StackConfig(placement=net, nats_cluster=3, ...))
        net.partition(["nats-2"], ["nats-0", "nats-1"])   # a node cut from its peers
        net.cut("scheduler-0")                  # a service cut from every NATS node, alive
        net.throttle("verifier-0", "256kbit")   # tc tbf, both directions
        net.heal()                              # every fault above undone

Layout: bridge `sbc<i>` holds 10.77.<i>.1/24 (the root namespace: the test's clients, the
gateways); namespace `sbc<i>-<name>` holds `eth0` at 10.77.<i>.<n> and its root end `sbc<i>v<n>`
is a port of the bridge. <i> is the first index whose bridge does not exist, so two harnesses
on one machine do not meet.

A partition is silent, as a real one is: blackhole routes for the other side's addresses in
each side's namespace (and in the root one when the root is a side), so packets vanish and TCP
connections stall instead of failing, and resume where they were once the routes go. A slow
link is a token bucket (`tc qdisc ... tbf`) on both ends of the veth; the kernel here has no
netem, so there is no added delay or loss, only a rate. Names are the Stack's instance ids
(`scheduler-0`) and `nats-<i>` for node i; `root` is this namespace.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field

ROOT = "root"
FIRST_HOST = 10  # address of the first namespace: .1 is the bridge, a few left spare
MAX_NAMESPACES = 200
TBF_BURST = "32kbit"
TBF_LATENCY = "400ms"  # how long a packet may wait in the bucket before it is dropped


class NetnsError(RuntimeError):
    """An `ip` or `tc` command failed (its stderr in the message)."""


def sh(*argv: str, check: bool = True) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def available() -> str | None:
    """None when namespaces can be made here, else why not (for a test's skip)."""
    probe = "sbcprobe"
    try:
        sh("ip", "netns", "add", probe)
        sh("ip", "netns", "del", probe)
    except (NetnsError, FileNotFoundError, subprocess.TimeoutExpired) as exc:
        return f"cannot make network namespaces here: {exc}"
    return None


def free_index() -> int:
    taken = set(sh("ip", "-o", "link", "show", "type", "bridge").split())
    return next(i for i in range(1, 250) if f"sbc{i}:" not in taken)


@dataclass
class Namespaces:
    """The namespaces of one harness (module docstring); a HostPlacement for services.launch.stack."""

    index: int
    addresses: dict[str, str] = field(default_factory=dict)  # name -> its address ("root": the bridge's)
    blackholes: set[tuple[str, str]] = field(default_factory=set)  # (in whose namespace, address)
    throttled: set[str] = field(default_factory=set)

    @classmethod
    def create(cls) -> Namespaces:
        net = cls(free_index())
        sh("ip", "link", "add", net.bridge, "type", "bridge")
        net.addresses[ROOT] = net.address(1)
        sh("ip", "addr", "add", f"{net.addresses[ROOT]}/24", "dev", net.bridge)
        sh("ip", "link", "set", net.bridge, "up")
        return net

    @property
    def bridge(self) -> str:
        return f"sbc{self.index}"

    def address(self, host: int) -> str:
        return f"10.77.{self.index}.{host}"

    def namespace(self, name: str) -> str:
        return f"sbc{self.index}-{name}"

    def veth(self, name: str) -> str:
        return f"sbc{self.index}v{self.addresses[name].rsplit('.', 1)[1]}"

    def add(self, name: str) -> str:
        """The namespace of `name` with its veth on the bridge (made once); returns its address."""
        if name in self.addresses:
            return self.addresses[name]
        if len(self.addresses) > MAX_NAMESPACES:
            raise NetnsError(f"more than {MAX_NAMESPACES} namespaces")
        address = self.addresses[name] = self.address(FIRST_HOST + len(self.addresses) - 1)
        ns, veth = self.namespace(name), self.veth(name)
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "link", "set", veth, "master", self.bridge)
        sh("ip", "link", "set", veth, "up")
        for argv in (("addr", "add", f"{address}/24", "dev", "eth0"), ("link", "set", "eth0", "up"),
                     ("link", "set", "lo", "up")):
            sh("ip", "-n", ns, *argv)
        return address

    def run_in(self, name: str) -> tuple[str, ...]:
        """The argv prefix that runs a program in name's namespace (`ip netns exec` execs it)."""
        self.add(name)
        return ("ip", "netns", "exec", self.namespace(name))

    # HostPlacement (services/launch/processes.py)
    def nats_nodes(self, size: int) -> tuple[tuple[str, tuple[str, ...]], ...]:
        return tuple((self.add(f"nats-{i}"), self.run_in(f"nats-{i}")) for i in range(size))

    def exec_prefix(self, role: str, instance_id: str) -> tuple[str, ...]:
        """Every service in its own namespace; a gateway stays in the root one, with the clients
        it serves over loopback HTTP (it is a NATS client like them)."""
        return () if role == "gateway" else self.run_in(instance_id)

    # faults
    def partition(self, side: list[str], other: list[str]) -> None:
        """Silently drop every packet between a name of `side` and a name of `other`."""
        for a, b in [(a, b) for a in side for b in other] + [(b, a) for a in side for b in other]:
            self.blackhole(a, self.addresses[b])

    def cut(self, name: str) -> None:
        """name cut from every NATS node (its process lives on, its connection stalls)."""
        self.partition([name], [n for n in self.addresses if n.startswith("nats-")])

    def blackhole(self, where: str, address: str) -> None:
        prefix = () if where == ROOT else ("-n", self.namespace(where))
        sh("ip", *prefix, "route", "add", "blackhole", f"{address}/32")
        self.blackholes.add((where, address))

    def throttle(self, name: str, rate: str) -> None:
        """A token bucket of `rate` (tc's units, e.g. "256kbit") on both ends of name's veth."""
        for prefix, dev in (((), self.veth(name)), (("-n", self.namespace(name)), "eth0")):
            sh("tc", *prefix, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
               "burst", TBF_BURST, "latency", TBF_LATENCY)
        self.throttled.add(name)

    def heal(self) -> None:
        """Undo every partition, cut and throttle."""
        for where, address in sorted(self.blackholes):
            prefix = () if where == ROOT else ("-n", self.namespace(where))
            sh("ip", *prefix, "route", "del", "blackhole", f"{address}/32", check=False)
        self.blackholes.clear()
        for name in sorted(self.throttled):
            sh("tc", "qdisc", "del", "dev", self.veth(name), "root", check=False)
            sh("tc", "-n", self.namespace(name), "qdisc", "del", "dev", "eth0", "root", check=False)
        self.throttled.clear()

    def close(self) -> None:
        """Every namespace (its veth goes with it) and the bridge; call once its processes are gone."""
        for name in [n for n in self.addresses if n != ROOT]:
            sh("ip", "netns", "del", self.namespace(name), check=False)
        sh("ip", "link", "del", self.bridge, check=False)
        self.addresses.clear()

    def __enter__(self) -> Namespaces:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

