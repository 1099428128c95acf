"""Local processes for the specs of a topology: start, wait for health, restart by policy, stop in order.

Each service runs in a session (process group) of its own, so a Ctrl-C in the terminal reaches only the
launcher, which then stops the services in reverse dependency order; signals go to the whole group, so a
service's own children go too. On Linux every service also gets SIGKILL if the launcher itself dies
(PR_SET_PDEATHSIG, set by launcher/parent_death.py before it execs the service): a launcher killed with
SIGKILL leaves no orphans holding ports or the arena.

The ranks of an expert-parallel group (ServiceSpec.group) live and die together: they step in lockstep, so one
that exits (or is restarted) breaks the others. When a member exits, the others still running are killed (SIGKILL
to their process groups: a hung member, even a stopped one, must not hold the restart up) and the group's ranks
are started again together, one group restart counting once against the restart limit. A hung member is its
peers' to detect: they exit with EXIT_GROUP_BROKEN, and the group's restart takes the hung one with them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from contracts.expert_parallel import EXIT_GROUP_BROKEN
from launcher.health_check import probe
from launcher.topology import ServiceSpec

STOP_GRACE_S = 20.0
POLL_S = 0.25
LOG_TAIL_LINES = 30
RESTART_WINDOW_S = 60.0
MAX_RESTARTS_IN_WINDOW = 3  # a service crashing more often than this is broken, not unlucky
KILL_WAIT_S = 10.0  # how long a SIGKILLed group member's processes may take to go (a GPU's memory to be freed)


class ServiceFailedError(RuntimeError):
    """A service exited or did not become healthy in time; the message carries the tail of its log."""

    def __init__(self, service: RunningService, reason: str) -> None:
        self.service = service
        self.reason = reason
        tail = service.log_tail()
        super().__init__(f"{service.spec.name} {reason}\n--- last lines of {service.log_path} ---\n{tail}")


@dataclass
class RunningService:
    spec: ServiceSpec
    process: subprocess.Popen[bytes]
    log_path: Path
    started_at: float
    restarts: list[float] = field(default_factory=list)  # monotonic times of restarts by policy
    recovering: bool = False  # restarted and not healthy yet
    restart_count: int = 0  # restarts since `up` started it (its group's included)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.rstrip().splitlines()[-lines:]) or "(empty log)"


@dataclass
class ServiceGroup:
    """The running members of one expert-parallel group, restarted as one."""

    name: str
    members: list[RunningService] = field(default_factory=list)  # in rank order
    restarts: list[float] = field(default_factory=list)  # monotonic times of group restarts (one each, not R)
    restart_count: int = 0
    last_restart_at: float | None = None  # wall-clock time (time.time()) of the last group restart
    first_exit: tuple[str, int] | None = None  # the last restart's cause: the member that exited first, its code
    restarted_at: float = 0.0  # monotonic time of the last restart
    recovering: bool = False  # restarted and not every member healthy yet

    def report(self) -> dict[str, object]:
        """What services.json says of the group."""
        cause = None if self.first_exit is None else {"member": self.first_exit[0], "code": self.first_exit[1]}
        return {
            "name": self.name,
            "members": [member.spec.name for member in self.members],
            "restarts": self.restart_count,
            "last_restart_at": self.last_restart_at,
            "first_exit": cause,
            "recovering": self.recovering,
        }


class Supervisor:
    """The running services of one `kvserve up`, in start order."""

    def __init__(self, log_dir: Path, out: Callable[[str], None]) -> None:
        self.log_dir = log_dir
        self.out = out
        self.services: list[RunningService] = []
        self.groups: dict[str, ServiceGroup] = {}  # expert-parallel groups by name
        log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)

    def start(self, spec: ServiceSpec) -> RunningService:
        log_path = self.log_dir / f"{spec.name}.log"
        # A fresh log per `up`, its user's alone (it holds session ids); a restart by policy appends to it.
        os.close(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
        log_path.chmod(0o600)
        service = RunningService(spec, self._spawn(spec, log_path), log_path, time.monotonic())
        self.services.append(service)
        if spec.group:
            self.groups.setdefault(spec.group, ServiceGroup(spec.group)).members.append(service)
        return service

    def _spawn(self, spec: ServiceSpec, log_path: Path) -> subprocess.Popen[bytes]:
        env = {**os.environ, **spec.environment}
        with log_path.open("ab") as log:
            log.write(f"--- kvserve up: starting {' '.join(spec.argv)}\n".encode())
            log.flush()
            argv = [sys.executable, "-m", "launcher.parent_death", *spec.argv] if sys.platform == "linux" else spec.argv
            return subprocess.Popen(
                list(argv),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # no preexec_fn: see launcher/parent_death.py
                umask=0o077,  # what it writes (Redis's dump and append-only files hold session ids) stays private
            )

    def wait_healthy(self, services: Sequence[RunningService]) -> None:
        """Return once every service answers its health check; raise ServiceFailedError as soon as one exits
        or passes its spec's startup_s."""
        pending = list(services)
        while pending:
            for service in list(pending):
                code = service.process.poll()
                if code is not None:
                    raise ServiceFailedError(service, f"exited with code {code} before it was healthy")
                reason = probe(service.spec.health)
                if reason is None:
                    elapsed = time.monotonic() - service.started_at
                    self.out(f"  {service.spec.name}: healthy after {elapsed:.1f} s ({service.spec.address})\n")
                    pending.remove(service)
                    continue
                if time.monotonic() - service.started_at > service.spec.startup_s:
                    limit = service.spec.startup_s
                    raise ServiceFailedError(service, f"was not healthy after {limit:.0f} s (last: {reason})")
            if pending:
                time.sleep(POLL_S)

    def watch(self) -> bool:
        """One look at the running stack: restart, per their policy, the services that exited (as docker's
        unless-stopped would), an expert-parallel group's members all together, and report restarted ones that
        became healthy again. True when what services.json reports changed (a pid, a recovery); raise
        ServiceFailedError for a service or group that keeps crashing."""
        changed = False
        for group in self.groups.values():
            exits = [(member, code) for member in group.members if (code := member.process.poll()) is not None]
            if exits:
                self._restart_group(group, exits)
                changed = True
        for service in self.services:
            code = service.process.poll()
            if code is None:
                if service.recovering and probe(service.spec.health) is None:
                    service.recovering = False
                    elapsed = time.monotonic() - service.started_at
                    self.out(f"{service.spec.name}: healthy again after {elapsed:.1f} s\n")
                    changed = True
                    self._note_group_recovered(service)
                continue
            if service.spec.group:
                continue  # exited since its group was looked at: the next look restarts the group
            now = time.monotonic()
            service.restarts = [at for at in service.restarts if now - at < RESTART_WINDOW_S]
            if service.spec.restart == "no" or len(service.restarts) >= MAX_RESTARTS_IN_WINDOW:
                raise ServiceFailedError(service, f"exited with code {code} and is not restarted again")
            self.out(
                f"{service.spec.name} exited with code {code}; restarting it (restart: {service.spec.restart})\n"
                f"--- last lines of {service.log_path} ---\n{service.log_tail(10)}\n"
            )
            _kill_group(service.process.pid, signal.SIGKILL)  # whatever it left behind in its group
            service.restarts.append(now)
            service.restart_count += 1
            service.started_at = now
            service.recovering = True
            service.process = self._spawn(service.spec, service.log_path)
            changed = True
        return changed

    def _restart_group(self, group: ServiceGroup, exits: list[tuple[RunningService, int]]) -> None:
        """Kill the group's members still running and start every member again; raise ServiceFailedError when
        the group has restarted too often (or a member's policy is not to restart)."""
        first, code = first_exit(exits)
        now = time.monotonic()
        group.restarts = [at for at in group.restarts if now - at < RESTART_WINDOW_S]
        if (
            any(member.spec.restart == "no" for member in group.members)
            or len(group.restarts) >= MAX_RESTARTS_IN_WINDOW
        ):
            recent = f"{len(group.restarts)} group restarts in the last {RESTART_WINDOW_S:.0f} s"
            raise ServiceFailedError(
                first,
                f"exited with code {code}; its expert-parallel group {group.name} is not restarted again ({recent})",
            )
        running = [member.spec.name for member in group.members if member.process.poll() is None]
        why = " (its group broke: a peer died or hung)" if code == EXIT_GROUP_BROKEN else ""
        killed = f"killing {', '.join(running)} and " if running else ""
        self.out(
            f"expert-parallel group {group.name}: {first.spec.name} exited first, with code {code}{why}; "
            f"{killed}restarting its {len(group.members)} ranks together (group restart {group.restart_count + 1})\n"
            f"--- last lines of {first.log_path} ---\n{first.log_tail(10)}\n"
        )
        for member in group.members:
            _kill_group(member.process.pid, signal.SIGKILL)  # SIGKILL ends a stopped process too
        deadline = time.monotonic() + KILL_WAIT_S
        for member in group.members:
            if not _wait_gone(member.process, deadline):
                self.out(f"{member.spec.name}: processes of its old group still there after {KILL_WAIT_S:.0f} s\n")
        now = time.monotonic()
        for member in group.members:
            member.restarts.append(now)
            member.restart_count += 1
            member.started_at = now
            member.recovering = True
            member.process = self._spawn(member.spec, member.log_path)
        group.restarts.append(now)
        group.restart_count += 1
        group.last_restart_at = time.time()
        group.first_exit = (first.spec.name, code)
        group.restarted_at = now
        group.recovering = True

    def _note_group_recovered(self, service: RunningService) -> None:
        group = self.groups.get(service.spec.group)
        if group is None or not group.recovering or any(member.recovering for member in group.members):
            return
        group.recovering = False
        elapsed = time.monotonic() - group.restarted_at
        self.out(f"expert-parallel group {group.name}: healthy again after {elapsed:.1f} s\n")

    def stop_all(self, tiers: Sequence[Sequence[ServiceSpec]], grace_s: float = STOP_GRACE_S) -> None:
        """Stop tier by tier, the last started first: SIGTERM to each process group, SIGKILL after grace_s."""
        by_name = {service.spec.name: service for service in self.services}
        for tier in reversed(tiers):
            running = [by_name[spec.name] for spec in tier if spec.name in by_name]
            for service in running:
                if service.process.poll() is None:
                    _kill_group(service.process.pid, signal.SIGTERM)
                    _kill_group(service.process.pid, signal.SIGCONT)  # a stopped one must see the SIGTERM
            deadline = time.monotonic() + grace_s
            for service in running:
                try:
                    service.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    self.out(f"{service.spec.name} did not stop within {grace_s:.0f} s; killing it\n")
                    _kill_group(service.process.pid, signal.SIGKILL)
                    service.process.wait()
                _kill_group(service.process.pid, signal.SIGKILL)  # children it left in its group


def first_exit(exits: list[tuple[RunningService, int]]) -> tuple[RunningService, int]:
    """Which of a group's exited members went first, of those seen exited at one look: EXIT_GROUP_BROKEN is a
    peer's answer to another member's end, so a member with any other code went before it; else rank order."""
    causes = [(service, code) for service, code in exits if code != EXIT_GROUP_BROKEN]
    return (causes or exits)[0]


def _wait_gone(process: subprocess.Popen[bytes], deadline: float) -> bool:
    """Reap a killed service and wait until nothing of its process group is left; False at the (monotonic)
    deadline."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=max(deadline - time.monotonic(), 0.1))
    while True:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False  # the group id went to another user's processes: not ours to wait for
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _kill_group(pgid: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # an empty group: nothing left to stop
        os.killpg(pgid, signum)
