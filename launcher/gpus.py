"""The GPUs this host has, as nvidia-smi lists them (the launcher's one way of asking)."""

from __future__ import annotations

import shutil
import subprocess


def listed_gpus() -> list[str] | None:
    """nvidia-smi's GPU indexes, or None where there is no nvidia-smi or its driver does not answer."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        listed = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [line.strip() for line in listed.splitlines() if line.strip()]
