"""`kvserve preflight` against a rendered compose file: each problem that would make `docker compose up` fail is
named with what to do, before anything starts, and a file with none passes."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from launcher.compose import render_compose
from launcher.preflight import check

ROOT = Path(__file__).resolve().parents[2]
SECRETS = ("kvserve-internal-secret", "kvserve-redis-password", "kvserve-keys.json")


def _render(tmp_path: Path, ranks: int = 2, cpu: bool = False, gateway_port: int = 8080) -> Path:
    config = tmp_path / "config.yaml"
    config.write_text(f"gateway_port: {gateway_port}\n")
    output = tmp_path / "docker-compose.yml"
    output.write_text(render_compose(ranks, config, output, None, cpu))
    return output


def _secrets(tmp_path: Path, mode: int = 0o600) -> None:
    for name in SECRETS:
        path = tmp_path / name
        path.write_text("x")
        path.chmod(mode)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_gpus_the_file_reserves_that_the_host_lacks(tmp_path: Path) -> None:
    compose = _render(tmp_path, ranks=2, gateway_port=_free_port())
    _secrets(tmp_path)
    problems = [str(p) for p in check(compose, gpus=["0"])]
    assert problems == [
        "rank-worker-1 reserves GPU 1, but this host has GPUs ['0']: render the file for this host: `kvserve compose "
        "--ranks N` with N at most the GPUs here, or `kvserve compose --cpu` for a CPU node"
    ]
    assert len(check(compose, gpus=None)) == 2  # no NVIDIA GPU at all: both ranks named
    assert check(compose, gpus=["0", "1"]) == []


def test_the_cpu_form_reserves_no_gpu(tmp_path: Path) -> None:
    compose = _render(tmp_path, ranks=2, cpu=True, gateway_port=_free_port())
    _secrets(tmp_path)
    assert check(compose, gpus=None) == []


def test_missing_or_open_secret_files_are_named_with_the_command_that_makes_them(tmp_path: Path) -> None:
    compose = _render(tmp_path, ranks=1, cpu=True, gateway_port=_free_port())
    problems = [str(p) for p in check(compose, gpus=None)]
    assert len(problems) == 3
    assert any(
        "kvserve_api_keys" in p and "kvserve keys create --name ops --file ./kvserve-keys.json" in p for p in problems
    )
    assert any(
        "kvserve_internal_secret" in p and "does not exist" in p and "kvserve secret create" in p for p in problems
    )
    _secrets(tmp_path, mode=0o644)
    problems = [str(p) for p in check(compose, gpus=None)]
    assert len(problems) == 3 and all("readable by others" in p and "chmod 600" in p for p in problems)
    _secrets(tmp_path)
    assert check(compose, gpus=None) == []


def test_a_published_port_in_use_is_named(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        port = holder.getsockname()[1]
        compose = _render(tmp_path, ranks=1, cpu=True, gateway_port=port)
        _secrets(tmp_path)
        problems = [str(p) for p in check(compose, gpus=None)]
        assert problems == [
            f"gateway publishes port {port}, which another process on this host holds: stop that process, or set "
            "gateway_port in the config and render the file again"
        ]
    assert check(compose, gpus=None) == []


def test_the_command_exits_1_naming_each_problem_before_anything_starts(tmp_path: Path) -> None:
    compose = _render(tmp_path, ranks=1, cpu=True, gateway_port=_free_port())
    run = [sys.executable, "-m", "launcher.cli", "preflight", "--file", str(compose)]
    result = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.count("error: secret ") == 3 and "3 problem(s) to fix" in result.stderr
    _secrets(tmp_path)
    result = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "ready for `docker compose up`" in result.stderr
    missing = subprocess.run([*run[:-1], str(tmp_path / "nope.yml")], cwd=ROOT, capture_output=True, text=True)
    assert missing.returncode == 1 and "render it with `kvserve compose`" in missing.stderr
