"""What the small_stack fixture (conftest.py) yields: a gateway in front of one rank worker with a short context."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

SMALL_CONTEXT = 256  # bounds the work any accepted request can cause


@dataclass(frozen=True)
class SmallStack:
    url: str
    port: int
    gateway_pid: int

    def gateway_rss_mb(self) -> float:
        """The gateway process's resident memory (VmRSS), in MB."""
        status = Path(f"/proc/{self.gateway_pid}/status").read_text()
        match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
        assert match, status
        return int(match.group(1)) / 1024
