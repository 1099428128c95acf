"""How much RAM the L1 arena may take: l1_host_gb, lowered to what the machine can give.

The plan is a pure function of the machine's readings so every case is unit-tested; `read_machine`
gathers the real readings (MemAvailable from /proc/meminfo, free space of the arena's filesystem).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30
MIB = 1 << 20
PAGE_BYTES = 4096
# The arena file must not fill its filesystem to the last byte: other tenants of /dev/shm (NCCL, torch
# shared tensors) need a little room too.
DIR_MARGIN_BYTES = 64 * MIB


@dataclass(frozen=True)
class MachineReadings:
    """What the machine can give right now; None where the reading is not available."""

    mem_available_bytes: int | None
    dir_free_bytes: int | None


@dataclass(frozen=True)
class RamBudget:
    requested_bytes: int
    granted_bytes: int
    reason: str  # why granted < requested; empty when the request was granted in full

    def describe(self) -> str:
        """One log-friendly sentence: requested vs granted and why."""
        text = f"requested {format_bytes(self.requested_bytes)}, granted {format_bytes(self.granted_bytes)}"
        return f"{text} ({self.reason})" if self.reason else f"{text} (as requested)"


def format_bytes(count: int) -> str:
    return f"{count / GIB:.2f} GiB" if count >= GIB else f"{count / MIB:.1f} MiB"


def plan_ram_budget(
    requested_gb: float,
    headroom_gb: float,
    readings: MachineReadings,
    arena_dir: str = "the arena dir",
    dir_margin_bytes: int = DIR_MARGIN_BYTES,
) -> RamBudget:
    """The arena size: requested_gb, at most MemAvailable minus the headroom and at most the arena
    filesystem's free space minus a margin, rounded down to whole pages (never negative)."""
    requested = _page_floor(int(requested_gb * GIB))
    granted, reason = requested, ""
    if readings.mem_available_bytes is not None:
        memory_limit = readings.mem_available_bytes - int(headroom_gb * GIB)
        if memory_limit < granted:
            granted = memory_limit
            reason = (
                f"MemAvailable {format_bytes(readings.mem_available_bytes)} minus l1_headroom_gb "
                f"{headroom_gb:g} leaves {format_bytes(max(memory_limit, 0))}"
            )
    if readings.dir_free_bytes is not None:
        dir_limit = readings.dir_free_bytes - dir_margin_bytes
        if dir_limit < granted:
            granted = dir_limit
            reason = (
                f"{arena_dir} has {format_bytes(readings.dir_free_bytes)} free, minus a "
                f"{format_bytes(dir_margin_bytes)} margin leaves {format_bytes(max(dir_limit, 0))}"
            )
    return RamBudget(requested_bytes=requested, granted_bytes=_page_floor(max(granted, 0)), reason=reason)


def _page_floor(count: int) -> int:
    return count - count % PAGE_BYTES


def parse_mem_available(meminfo_text: str) -> int | None:
    """MemAvailable in bytes from the text of /proc/meminfo ("MemAvailable:   123456 kB")."""
    for line in meminfo_text.splitlines():
        if line.startswith("MemAvailable:"):
            fields = line.split()
            if len(fields) >= 2 and fields[1].isdigit():
                unit = 1024 if len(fields) > 2 and fields[2].lower() == "kb" else 1
                return int(fields[1]) * unit
    return None


def read_machine(arena_dir: str | Path, meminfo_path: str | Path = "/proc/meminfo") -> MachineReadings:
    """The real readings for arena_dir (a reading that fails is None, not an error)."""
    try:
        mem_available = parse_mem_available(Path(meminfo_path).read_text())
    except OSError:
        mem_available = None
    try:
        stat = os.statvfs(arena_dir)
        dir_free = stat.f_bavail * stat.f_frsize
    except OSError:
        dir_free = None
    return MachineReadings(mem_available_bytes=mem_available, dir_free_bytes=dir_free)
