"""What a benchmark ran: the checkout's commit and a hash of its uncommitted changes, recorded in every result
file, so that a number can be traced to the code that made it (a commit alone hides an uncommitted edit).
Pure Python and git (loadgen/__init__ imports nothing): bench/peer_vllm.py imports it inside vLLM's own site,
every result writer (loadgen, simulator, bench) records it, and the GPU shell scripts run it as a script."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path


def _git(root: Path, *args: str) -> bytes | None:
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def provenance(root: str | Path) -> dict[str, str | bool | None]:
    """commit (full hash), diff_sha256 (sha-256 of `git diff HEAD` plus the untracked, not ignored files' names
    and contents; None when the tree is clean) and dirty. Every value is None outside a git checkout."""
    root = Path(root)
    head = _git(root, "rev-parse", "HEAD")
    if head is None:
        return {"commit": None, "diff_sha256": None, "dirty": None}
    digest = hashlib.sha256()
    diff = _git(root, "diff", "HEAD", "--binary") or b""
    digest.update(diff)
    untracked = (_git(root, "ls-files", "--others", "--exclude-standard", "-z") or b"").split(b"\0")
    names = sorted(name for name in untracked if name)
    for name in names:
        digest.update(b"\0untracked\0" + name + b"\0")
        path = root / name.decode(errors="surrogateescape")
        if path.is_file():
            digest.update(path.read_bytes())
    dirty = bool(diff) or bool(names)
    return {"commit": head.decode().strip(), "diff_sha256": digest.hexdigest() if dirty else None, "dirty": dirty}


CHECKOUT = Path(__file__).resolve().parents[1]  # where loadgen runs from a checkout (not a git tree when installed)


def checkout_record(commit: str | None = None) -> dict[str, object]:
    """A result file's "commit" (the one given, e.g. by a GPU call whose copy's HEAD is older than its code, else
    the checkout's; "" outside a git checkout) and "provenance" (provenance() of the checkout this code runs from)."""
    code = provenance(CHECKOUT)
    return {"commit": commit or code["commit"] or "", "provenance": code}


if __name__ == "__main__":  # the GPU scripts: `python3 loadgen/provenance.py [ROOT]` prints provenance(ROOT) as JSON
    print(json.dumps(provenance(sys.argv[1] if len(sys.argv) > 1 else ".")))
