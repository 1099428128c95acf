"""Local processes for the specs of a topology: start, wait for health, restart by policy, stop in order.

Each service runs in a session (process group) of its own, so a Ctrl-C in the terminal reaches only the
launcher, which then stops the services in reverse dependency order; signals go to the whole group, so a
service's own children go too. On Linux every service also gets SIGKILL if the launcher itself dies
(PR_SET_PDEATHSIG, set by launcher/parent_death.py before it execs the service): a launcher killed with
SIGKILL leaves no orphans holding ports or the arena.
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

from launcher.health_check import probe
from launcher.topology import ServiceSpec

STOP_GRACE_S = 20.0
POLL_S = 0.25
LOG_TAIL_LINES = 30
RESTART_WINDOW_S = 60.0
MAX_RESTARTS_IN_WINDOW = 3  # a service crashing more often than this is broken, not unlucky


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

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.rstrip().splitlines()[-lines:]) or "(empty log)"


class Supervisor:
    """The running services of one `kvserve up`, in start order."""

    def __init__(self, log_dir: Path, out: Callable[[str], None]) -> None:
        self.log_dir = log_dir
        self.out = out
        self.services: list[RunningService] = []
        log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)

    def start(self, spec: ServiceSpec) -> RunningService:
        log_path = self.log_dir / f"{spec.name}.log"
        # A fresh log per `up`, its user's alone (it holds session ids); a restart by policy appends to it.
        os.close(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
        log_path.chmod(0o600)
        service = RunningService(spec, self._spawn(spec, log_path), log_path, time.monotonic())
        self.services.append(service)
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
        unless-stopped would) and report restarted ones that became healthy again. True when a service was
        restarted (its pid changed); raise ServiceFailedError for one that keeps crashing."""
        restarted = False
        for service in self.services:
            code = service.process.poll()
            if code is None:
                if service.recovering and probe(service.spec.health) is None:
                    service.recovering = False
                    elapsed = time.monotonic() - service.started_at
                    self.out(f"{service.spec.name}: healthy again after {elapsed:.1f} s\n")
                continue
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
            service.started_at = now
            service.recovering = True
            service.process = self._spawn(service.spec, service.log_path)
            restarted = True
        return restarted

    def stop_all(self, tiers: Sequence[Sequence[ServiceSpec]], grace_s: float = STOP_GRACE_S) -> None:
        """Stop tier by tier, the last started first: SIGTERM to each process group, SIGKILL after grace_s."""
        by_name = {service.spec.name: service for service in self.services}
        for tier in reversed(tiers):
            running = [by_name[spec.name] for spec in tier if spec.name in by_name]
            for service in running:
                if service.process.poll() is None:
                    _kill_group(service.process.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for service in running:
                try:
                    service.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    self.out(f"{service.spec.name} did not stop within {grace_s:.0f} s; killing it\n")
                    _kill_group(service.process.pid, signal.SIGKILL)
                    service.process.wait()
                _kill_group(service.process.pid, signal.SIGKILL)  # children it left in its group


def _kill_group(pgid: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # an empty group: nothing left to stop
        os.killpg(pgid, signum)
