"""`kvserve preflight`: what would make `docker compose up` of a rendered compose file fail, found before anything
starts, each with what to do about it: GPUs reserved that this host does not have, secret files that are missing
(or readable by others), and published ports another process already holds."""

from __future__ import annotations

import socket
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from launcher.gpus import listed_gpus

SECRET_COMMANDS = {  # how each of the compose file's secrets is made (docs/compose.md)
    "kvserve_internal_secret": "kvserve secret create --file {path}",
    "kvserve_redis_password": "kvserve secret create --file {path}",
    "kvserve_api_keys": "kvserve keys create --name ops --file {path}",
}


@dataclass(frozen=True)
class Problem:
    what: str
    fix: str

    def __str__(self) -> str:
        return f"{self.what}: {self.fix}"


def host_gpus() -> list[str] | None:
    """The GPU indexes nvidia-smi lists, or None where there is no nvidia-smi (no NVIDIA driver)."""
    return listed_gpus()


def port_taken(port: int, host: str = "0.0.0.0") -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def check(compose_file: Path, gpus: list[str] | None = None, probe_ports: bool = True) -> list[Problem]:
    """Every problem found in the compose file against this host (gpus: the host's GPU indexes; None: none)."""
    spec: dict[str, Any] = yaml.safe_load(compose_file.read_text()) or {}
    base = compose_file.resolve().parent
    return [
        *_gpu_problems(spec, gpus),
        *_secret_problems(spec, base),
        *(_port_problems(spec) if probe_ports else []),
    ]


def _gpu_problems(spec: dict[str, Any], gpus: list[str] | None) -> list[Problem]:
    have = set(gpus or [])
    problems = []
    for name, service in (spec.get("services") or {}).items():
        devices = (((service.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices")
        for device in devices or []:
            for gpu in device.get("device_ids") or []:
                if str(gpu) not in have:
                    present = f"GPUs {sorted(have)}" if have else "no NVIDIA GPU (nvidia-smi lists none)"
                    problems.append(
                        Problem(
                            f"{name} reserves GPU {gpu}, but this host has {present}",
                            "render the file for this host: `kvserve compose --ranks N` with N at most the GPUs "
                            "here, or `kvserve compose --cpu` for a CPU node",
                        )
                    )
    return problems


def _secret_problems(spec: dict[str, Any], base: Path) -> list[Problem]:
    problems = []
    for name, secret in (spec.get("secrets") or {}).items():
        file = (secret or {}).get("file")
        if not file:
            continue
        path = (base / file).resolve()
        command = SECRET_COMMANDS.get(name, "create it").format(path=file)
        if not path.is_file():
            problems.append(Problem(f"secret {name}: {path} does not exist", f"make it with `{command}`"))
        elif path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            problems.append(
                Problem(
                    f"secret {name}: {path} is readable by others", f"`chmod 600 {file}` (or remake it: `{command}`)"
                )
            )
    return problems


def _port_problems(spec: dict[str, Any]) -> list[Problem]:
    problems = []
    for name, service in (spec.get("services") or {}).items():
        for entry in service.get("ports") or []:
            published = _published_port(entry)
            if published is not None and port_taken(published):
                problems.append(
                    Problem(
                        f"{name} publishes port {published}, which another process on this host holds",
                        "stop that process, or set gateway_port in the config and render the file again",
                    )
                )
    return problems


def _published_port(entry: Any) -> int | None:
    """The host port of a compose ports entry ("8080:8080", "127.0.0.1:8080:8080", {published: 8080, ...})."""
    if isinstance(entry, dict):
        value = entry.get("published")
        return int(value) if value is not None else None
    parts = str(entry).split(":")
    return int(parts[-2]) if len(parts) >= 2 and parts[-2].isdigit() else None
