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
    rank_port: int  # another gateway may share the rank worker

    def gateway_rss_mb(self) -> float:
        """The gateway process's resident memory (VmRSS), in MB."""
        return self._gateway_status_mb("VmRSS")

    def gateway_peak_mb(self) -> float:
        """The gateway process's peak resident memory (VmHWM) since it started or reset_gateway_peak, in MB."""
        return self._gateway_status_mb("VmHWM")

    def reset_gateway_peak(self) -> None:
        Path(f"/proc/{self.gateway_pid}/clear_refs").write_text("5")  # VmHWM starts again from VmRSS

    def _gateway_status_mb(self, field: str) -> float:
        status = Path(f"/proc/{self.gateway_pid}/status").read_text()
        match = re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE)
        assert match, status
        return int(match.group(1)) / 1024
