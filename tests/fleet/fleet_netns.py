"""Network namespaces for the fleet tests: machines on one private network, all on this one.

A bridge lives in a namespace of its own; every other namespace (the nodes, the edge with Envoy and the EPP) is
joined to it by a veth pair, with an address of a private /24 that exists only inside these namespaces. Nothing is
ever sent from the host's own namespace to those addresses (a private address not on this machine would leave it):
every process that uses them, clients and readiness probes included, runs inside a namespace through `ip netns
exec`. Names carry this process's pid and a counter, so parallel runs never share one, and a later run removes
what a killed run left (its pid gone).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

PREFIX = "kvs-fleet-"
SUBNET = "10.77.0"  # the /24 inside the namespaces; each run has its own bridge, so runs never share an address
EDGE_HOST = 2
FIRST_NODE_HOST = 11
_OWN_NAME = re.compile(rf"^{PREFIX}(\d+)-")  # kvs-fleet-<pid>-...: this suite's, made by process <pid>
_counter = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable_reason() -> str | None:
    """Why this machine cannot run the fleet tests, or None: they need root, `ip netns` and veth pairs."""
    if sys.platform != "linux":
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    name = f"{PREFIX}{os.getpid()}-probe-{next(_counter)}"
    try:
        added = _ip("netns", "add", name, check=False)
        if added.returncode != 0:
            return f"`ip netns add` fails here: {added.stderr.strip()}"
        veth = _ip("-n", name, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1", check=False)
        if veth.returncode != 0:
            return f"no veth pairs in a network namespace here: {veth.stderr.strip()}"
    finally:
        _ip("netns", "del", name, check=False)
    return None


def namespace_pids(name: str) -> list[int]:
    result = _ip("netns", "pids", name, check=False)
    return [int(pid) for pid in result.stdout.split()] if result.returncode == 0 else []


def kill_namespace_processes(name: str, sig: signal.Signals = signal.SIGKILL, timeout_s: float = 10) -> None:
    """`sig` to every process in namespace `name`, then (for SIGKILL) until none is left."""
    for pid in namespace_pids(name):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    if sig != signal.SIGKILL:
        return
    deadline = time.monotonic() + timeout_s
    while namespace_pids(name) and time.monotonic() < deadline:
        time.sleep(0.05)


def remove_namespace(name: str) -> None:
    kill_namespace_processes(name)
    _ip("netns", "del", name, check=False)


def remove_leftovers() -> None:
    """Namespaces a killed earlier run left behind (its pid no longer alive), with their processes."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    for line in listed:
        name = line.split(" ")[0]
        match = _OWN_NAME.match(name)
        if match is None:
            continue
        pid = int(match.group(1))
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            remove_namespace(name)
        except PermissionError:
            pass  # alive, another user's


@dataclass(frozen=True)
class Namespace:
    name: str
    address: str  # on the fleet's /24

    def exec_args(self, *args: str) -> list[str]:
        """Run args inside this namespace; the process is SIGKILLed if the one that started it dies (a killed
        test run leaves nothing running; launcher.parent_death, then `ip netns exec` execs args in place)."""
        return [sys.executable, "-m", "launcher.parent_death", "ip", "netns", "exec", self.name, *args]

    def pids(self) -> list[int]:
        return namespace_pids(self.name)

    def kill_all(self, sig: signal.Signals = signal.SIGKILL) -> None:
        kill_namespace_processes(self.name, sig)


@dataclass
class Network:
    """The bridge namespace and one namespace per machine, made by `network()` and removed at its end."""

    run: str  # the unique part of every name: kvs-<pid>-<n>-
    bridge: str = ""
    machines: dict[str, Namespace] = field(default_factory=dict)

    def __getitem__(self, role: str) -> Namespace:
        return self.machines[role]

    def add_machine(self, role: str, host: int) -> Namespace:
        namespace = Namespace(f"{self.run}{role}", f"{SUBNET}.{host}")
        port = f"p{len(self.machines)}"  # its veth end in the bridge namespace
        self.machines[role] = namespace  # before it exists: a failure half way is still removed
        _ip("netns", "add", namespace.name)
        _ip("-n", namespace.name, "link", "set", "lo", "up")
        _ip("link", "add", "eth0", "netns", namespace.name, "type", "veth", "peer", "name", port, "netns", self.bridge)
        _ip("-n", self.bridge, "link", "set", port, "master", "br0")
        _ip("-n", self.bridge, "link", "set", port, "up")
        _ip("-n", namespace.name, "addr", "add", f"{namespace.address}/24", "dev", "eth0")
        _ip("-n", namespace.name, "link", "set", "eth0", "up")
        return namespace

    def remove(self) -> None:
        for namespace in self.machines.values():
            remove_namespace(namespace.name)
        if self.bridge:
            remove_namespace(self.bridge)


@contextlib.contextmanager
def network(roles: Sequence[tuple[str, int]]) -> Iterator[Network]:
    """A private network of namespaces, one per (role, host number) on SUBNET; everything in them is killed and
    the namespaces removed at the end, whatever happened."""
    remove_leftovers()
    net = Network(f"{PREFIX}{os.getpid()}-{next(_counter)}-")
    try:
        net.bridge = f"{net.run}br"
        _ip("netns", "add", net.bridge)
        _ip("-n", net.bridge, "link", "set", "lo", "up")
        _ip("-n", net.bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", net.bridge, "link", "set", "br0", "up")
        for role, host in roles:
            net.add_machine(role, host)
        yield net
    finally:
        net.remove()
