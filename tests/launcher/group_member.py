"""A stand-in rank of an expert-parallel group for the supervisor's tests: `python group_member.py PORT CHILD_FILE`.

It answers HTTP GET with 200 (its health), keeps a child process in its process group (as a rank's compile
workers would be) and writes that child's pid to CHILD_FILE; SIGUSR1 makes it exit as a rank whose group broke.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

from contracts.expert_parallel import EXIT_GROUP_BROKEN


class Healthy(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


def main(port: int, child_file: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    child_file.write_text(str(child.pid))
    signal.signal(signal.SIGUSR1, lambda signum, frame: os._exit(EXIT_GROUP_BROKEN))
    HTTPServer(("127.0.0.1", port), Healthy).serve_forever(poll_interval=0.1)


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]))
