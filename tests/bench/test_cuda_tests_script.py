"""bench/cuda_tests.sh with ONLY_TESTS runs those pytest arguments alone and logs them with the provenance (run here
on the CPU over a CPU test file; on the GPU machine the same call runs CUDA cases)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_only_tests_runs_those_tests_alone(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "OUT": str(tmp_path),
        "USE_WHEELS": "0",  # no GPU kit here: this checkout's environment
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "ONLY_TESTS": "tests/rank_worker/test_mla_windows.py -k merging",
    }
    done = subprocess.run(
        ["bash", "bench/cuda_tests.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    log = (tmp_path / "cuda-tests-only.log").read_text()
    assert "1 passed" in log and "pytest rc=0" in log, log
    assert not (tmp_path / "cuda-tests-kernels.log").exists()  # nothing else ran
    assert '"commit"' in (tmp_path / "provenance.txt").read_text()
