"""`python -m launcher.parent_death ARGV...`: ask Linux to SIGKILL this process when its parent (the launcher)
dies, then exec ARGV in its place (the request survives exec).

This replaces a preexec_fn in the launcher: a preexec_fn forces a plain fork, and a fork of a process with
live gRPC channels (the launcher's health probes) can crash the child before exec (grpc/grpc#43055)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m launcher.parent_death COMMAND [ARGS...]", file=sys.stderr)
        return 2
    parent = os.getppid()
    if sys.platform == "linux":
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the launcher died before the request was made
            return 1
    os.execvp(argv[0], argv)
    return 127  # not reached: execvp raises on failure


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
