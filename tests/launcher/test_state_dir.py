"""`kvserve up`'s state dir: private to its user (logs and Redis's files hold session ids), with a real
redis-server writing its dump and append-only files there; a restart keeps the last run's logs in logs.prev."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from service_processes import free_port

from contracts.config import KvServeConfig
from launcher.stack_secrets import prepare_local_secrets
from launcher.state_dir import IGNORE_EVERYTHING, prepare_state_dir
from launcher.supervisor import Supervisor
from launcher.topology import REDIS_PASSWORD, StackPlan, build_topology, local_secret_path
from launcher.up import write_services_file


def modes(root: Path) -> dict[str, int]:
    """Every path under root (itself included) and its permission bits."""
    found = {".": stat.S_IMODE(root.stat().st_mode)}
    for directory, directories, files in os.walk(root):
        for name in directories + files:
            path = Path(directory, name)
            found[str(path.relative_to(root))] = stat.S_IMODE(path.lstat().st_mode)
    return found


def not_private(root: Path) -> dict[str, str]:
    return {
        name: oct(mode) for name, mode in modes(root).items() if mode != (0o700 if (root / name).is_dir() else 0o600)
    }


def test_redis_files_logs_and_services_json_are_private(tmp_path: Path) -> None:
    import redis

    state_dir = tmp_path / "state"
    log_dir = prepare_state_dir(state_dir)
    prepare_local_secrets(state_dir)
    config = KvServeConfig(redis_url=f"redis://127.0.0.1:{free_port()}/0")  # type: ignore[call-arg]
    redis_spec = build_topology(config, 1, StackPlan(mode="local", state_dir=state_dir))[0]
    supervisor = Supervisor(log_dir, lambda text: None)
    try:
        supervisor.wait_healthy([supervisor.start(redis_spec)])
        write_services_file(supervisor, state_dir / "services.json")
        password = local_secret_path(state_dir, REDIS_PASSWORD).read_text().strip()
        client = redis.Redis(host="127.0.0.1", port=redis_spec.port, password=password)
        client.set("session:0f1e2d", "a session id")  # into the append-only file
        client.save()  # dump.rdb
    finally:
        supervisor.stop_all([[redis_spec]])
    written = modes(state_dir)
    assert {"redis/dump.rdb", "redis/appendonlydir", "logs/redis.log", "services.json"} <= set(written)
    assert not_private(state_dir) == {}


def test_a_restart_keeps_the_last_runs_logs(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    for run in (1, 2):
        (prepare_state_dir(state_dir) / "gateway.log").write_text(f"run {run}\n")
    assert (state_dir / "logs.prev" / "gateway.log").read_text() == "run 1\n"
    assert (state_dir / "logs" / "gateway.log").read_text() == "run 2\n"
    prepare_state_dir(state_dir)  # a start that fails before any service wrote a log...
    prepare_state_dir(state_dir)  # ...does not push the last real run's logs out
    assert (state_dir / "logs.prev" / "gateway.log").read_text() == "run 2\n"
    assert list((state_dir / "logs").iterdir()) == []


def test_an_earlier_versions_readable_state_dir_is_made_private(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    for directory in (state_dir, state_dir / "redis" / "appendonlydir", state_dir / "logs"):
        directory.mkdir(mode=0o755, parents=True)
        directory.chmod(0o755)
    (state_dir / ".gitignore").write_text(IGNORE_EVERYTHING)
    for name in ("redis/dump.rdb", "redis/appendonlydir/appendonly.aof.1.incr.aof", "logs/gateway.log"):
        (state_dir / name).write_text("session ids")
        (state_dir / name).chmod(0o644)
    prepare_state_dir(state_dir)
    assert not_private(state_dir) == {}
    assert (state_dir / "logs.prev" / "gateway.log").exists()


def test_a_directory_kvserve_did_not_make_keeps_its_mode(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    (shared / "theirs.txt").write_text("not ours")
    (shared / "theirs.txt").chmod(0o644)
    prepare_state_dir(shared)
    found = modes(shared)
    assert (found["."], found["theirs.txt"]) == (0o755, 0o644)
    assert (found["logs"], found["redis"], found[".gitignore"]) == (0o700, 0o700, 0o600)
