"""The ports test stacks get: free_port never hands out one port twice, in one process or across processes (xdist
workers, other test runs), while the one it went to lives; asking the OS alone (bind to port 0, close) repeats
ports within a few hundred calls, and two ranks of one stack once got the same port that way."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from service_processes import ROOT, PortClaims, service_env

CALLS = 1000  # asking the OS alone repeats a port within a few hundred (~14K ports in the ephemeral range)


def test_free_port_never_repeats_a_port() -> None:
    # In a process of its own, so that its claims go when it exits instead of staying with this worker's.
    script = (
        f"import json, service_processes; print(json.dumps([service_processes.free_port() for _ in range({CALLS})]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT / "tests",
        env=service_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    ports = json.loads(result.stdout)
    repeated = sorted({port for port in ports if ports.count(port) > 1})
    assert len(ports) == CALLS and repeated == []


def test_two_processes_sharing_the_claims_never_get_one_port(tmp_path: Path) -> None:
    workers = [PortClaims(tmp_path), PortClaims(tmp_path)]  # as two xdist workers, each with its own memory
    try:
        ports = [workers[call % 2].take() for call in range(CALLS)]
        assert len(set(ports)) == CALLS
        assert workers[0].claimed.isdisjoint(workers[1].claimed)
    finally:
        for worker in workers:
            worker.release()
    assert list(tmp_path.iterdir()) == []


def test_a_dead_process_claim_does_not_hold_its_port(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "40000").write_text(dead.stdout.strip())
    claims = PortClaims(tmp_path)
    assert claims._claim(40000) is False  # not on this pick: another process may be removing it too
    assert not (tmp_path / "40000").exists()
    assert claims._claim(40000) is True
    claims.release()
