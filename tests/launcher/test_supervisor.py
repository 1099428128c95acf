"""The local supervisor with an expert-parallel group of stand-in ranks (tests/launcher/group_member.py): a member
SIGKILLed, or exiting with EXIT_GROUP_BROKEN while another is stopped (SIGSTOP), takes its whole group down (every
process of every member) and up again together, counted as one group restart; a service outside the group is left
alone; a group that keeps crashing stops the stack; a stopped member does not hold up the stack's stop."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from service_processes import free_port, service_env

from contracts.expert_parallel import EXIT_GROUP_BROKEN
from launcher.health_check import HealthCheck
from launcher.supervisor import RunningService, ServiceFailedError, Supervisor
from launcher.topology import ServiceSpec
from launcher.up import write_services_file

MEMBER = Path(__file__).with_name("group_member.py")
GROUP = "ep-0"
TIMEOUT_S = 60.0


def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not after {timeout_s:.0f} s"
        time.sleep(0.05)


def group_gone(pgid: int) -> bool:
    """Nothing left of the process group a service led (the service and its children)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def process_state(pid: int) -> str:
    """The state letter /proc gives a process: R, S, T (stopped), Z (exited, not reaped yet), ..."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


def member_spec(tmp_path: Path, name: str, group: str) -> ServiceSpec:
    port = free_port()
    return ServiceSpec(
        name=name,
        role="rank-worker",
        argv=(sys.executable, str(MEMBER), str(port), str(tmp_path / f"{name}.child")),
        host="127.0.0.1",
        port=port,
        address=f"127.0.0.1:{port}",
        health=HealthCheck("http", f"http://127.0.0.1:{port}/"),
        environment={"PYTHONPATH": service_env()["PYTHONPATH"]},
        startup_s=TIMEOUT_S,
        group=group,
    )


@dataclass
class Stack:
    supervisor: Supervisor
    lines: list[str]
    specs: list[ServiceSpec]
    tmp_path: Path

    def service(self, name: str) -> RunningService:
        return next(service for service in self.supervisor.services if service.spec.name == name)

    def text(self) -> str:
        return "".join(self.lines)

    def child_pid(self, name: str) -> int:
        path = self.tmp_path / f"{name}.child"
        wait_until(lambda: path.is_file() and path.read_text().strip() != "", f"{name} wrote its child's pid")
        return int(path.read_text())

    def watch_until_restarted(self) -> None:
        wait_until(self.supervisor.watch, "a restart")

    def watch_until_recovered(self) -> None:
        wait_until(
            lambda: not self.supervisor.watch() and not any(s.recovering for s in self.supervisor.services),
            "every service healthy again",
        )


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    lines: list[str] = []
    supervisor = Supervisor(tmp_path / "logs", lines.append)
    specs = [member_spec(tmp_path, "member-0", GROUP), member_spec(tmp_path, "member-1", GROUP)]
    specs.append(member_spec(tmp_path, "solo", ""))  # in no group: a group's restart leaves it alone
    try:
        supervisor.wait_healthy([supervisor.start(spec) for spec in specs])
        yield Stack(supervisor, lines, specs, tmp_path)
    finally:
        supervisor.stop_all([specs], grace_s=10)


def test_a_killed_member_restarts_its_whole_group(stack: Stack) -> None:
    solo_pid = stack.service("solo").process.pid
    before = {name: stack.service(name).process.pid for name in ("member-0", "member-1")}
    children = {name: stack.child_pid(name) for name in before}
    (stack.tmp_path / "member-0.child").unlink()  # written again by the restarted member

    os.kill(before["member-1"], signal.SIGKILL)
    stack.watch_until_restarted()

    text = stack.text()
    assert (
        "expert-parallel group ep-0: member-1 exited first, with code -9; killing member-0 and restarting its "
        "2 ranks together (group restart 1)\n" in text
    )
    assert text.count("exited first") == 1
    for name, pid in before.items():
        assert group_gone(pid), f"{name}: its old process group (the rank and its child) is gone"
        assert stack.service(name).process.pid != pid
    assert stack.service("solo").process.pid == solo_pid
    group = stack.supervisor.groups[GROUP]
    assert (group.restart_count, group.first_exit, len(group.restarts)) == (1, ("member-1", -9), 1)
    assert [stack.service(name).restart_count for name in ("member-0", "member-1", "solo")] == [1, 1, 0]

    stack.watch_until_recovered()
    assert "member-0: healthy again" in stack.text() and "member-1: healthy again" in stack.text()
    assert "expert-parallel group ep-0: healthy again after" in stack.text()
    assert stack.child_pid("member-0") != children["member-0"]  # a fresh process group, child and all

    write_services_file(stack.supervisor, stack.tmp_path / "services.json")
    report = json.loads((stack.tmp_path / "services.json").read_text())
    (entry,) = report["groups"]
    assert entry["name"] == GROUP and entry["members"] == ["member-0", "member-1"]
    assert entry["restarts"] == 1 and entry["first_exit"] == {"member": "member-1", "code": -9}
    assert entry["recovering"] is False and entry["last_restart_at"] <= time.time()
    services = {service["name"]: service for service in report["services"]}
    assert services["member-0"]["group"] == GROUP and "group" not in services["solo"]
    assert [services[name]["restarts"] for name in ("member-0", "member-1", "solo")] == [1, 1, 0]


def test_a_member_exiting_75_restarts_its_group_and_a_stopped_member_goes_with_it(stack: Stack) -> None:
    stopped, broken = stack.service("member-0").process.pid, stack.service("member-1").process.pid
    os.kill(stopped, signal.SIGSTOP)  # hung: its peers' watchdog would time it out and exit 75
    wait_until(lambda: process_state(stopped) == "T", "member-0 stopped")
    os.kill(broken, signal.SIGUSR1)
    stack.watch_until_restarted()

    assert (
        f"expert-parallel group ep-0: member-1 exited first, with code {EXIT_GROUP_BROKEN} (its group broke: a peer "
        "died or hung); killing member-0 and restarting its 2 ranks together (group restart 1)\n" in stack.text()
    )
    assert group_gone(stopped) and group_gone(broken)  # the SIGKILL reached the stopped member
    stack.watch_until_recovered()
    assert stack.supervisor.groups[GROUP].restart_count == 1


def test_members_seen_exited_at_one_look_restart_their_group_once(stack: Stack) -> None:
    """A peer's 75 answers another member's end: of members that exited between two looks, the other code went
    first; they restart once, together."""
    members = [stack.service("member-0").process.pid, stack.service("member-1").process.pid]
    os.kill(members[0], signal.SIGUSR1)
    os.kill(members[1], signal.SIGKILL)
    wait_until(lambda: all(process_state(pid) == "Z" for pid in members), "both members exited")
    assert stack.supervisor.watch()

    assert "member-1 exited first, with code -9; restarting its 2 ranks together (group restart 1)" in stack.text()
    assert stack.text().count("exited first") == 1
    assert stack.supervisor.groups[GROUP].restart_count == 1
    stack.watch_until_recovered()
    assert stack.supervisor.groups[GROUP].restart_count == 1


def test_a_group_that_keeps_crashing_is_not_restarted_again(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("launcher.supervisor.MAX_RESTARTS_IN_WINDOW", 2)
    for restart in (1, 2):
        os.kill(stack.service("member-0").process.pid, signal.SIGKILL)
        stack.watch_until_restarted()
        assert f"(group restart {restart})" in stack.text()
    os.kill(stack.service("member-0").process.pid, signal.SIGKILL)
    with pytest.raises(ServiceFailedError, match="its expert-parallel group ep-0 is not restarted again"):
        stack.watch_until_restarted()


def test_a_stopped_member_does_not_hold_up_the_stop(stack: Stack) -> None:
    pid = stack.service("member-1").process.pid
    os.kill(pid, signal.SIGSTOP)
    wait_until(lambda: process_state(pid) == "T", "member-1 stopped")
    stack.supervisor.stop_all([stack.specs], grace_s=10)
    assert "did not stop within" not in stack.text()  # SIGTERM reached it (SIGCONT), no SIGKILL needed
    # the children the stop's SIGKILL orphaned are init's to reap
    wait_until(lambda: all(group_gone(service.process.pid) for service in stack.supervisor.services), "all gone")
