"""Test-wide settings: the repo root importable, and torch threads split between xdist workers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))


# --dist loadfile hands files out in xdist's order (most tests first) and queues one more file behind a worker's
# last two pending tests. A long file handed out late then runs alone while the other worker idles: the Claude
# Code CLI files (cold prefills of 12-23K tokens) did, for the last ~15 minutes of a 27-minute run. Handing the
# longest files out first (longest processing time first) leaves only short files for the end. The order: the
# files' wall times in a CI-like run (2 cores), longest first; a file not named here keeps xdist's order after
# them. A stale list costs only balance, never a test.
LONGEST_FILES_FIRST = (
    "tests/gateway/test_claude_code_e2e.py",
    "tests/gateway/test_claude_code_older_e2e.py",
    "tests/gateway/test_failures_e2e.py",
    "tests/fleet/test_fleet_e2e.py",
    "tests/gateway/epp/test_epp_e2e.py",
    "tests/rank_worker/test_expert_parallel_engine.py",
    "tests/e2e/test_rank_recovery_e2e.py",
    "tests/e2e/test_expert_parallel_e2e.py",
    "tests/e2e/test_service_failures_e2e.py",
    "tests/e2e/test_routing_e2e.py",
    "tests/gateway/test_anthropic_e2e.py",
    "tests/rank_worker/test_batching.py",
    "tests/e2e/test_hung_services_e2e.py",
    "tests/e2e/test_gateway_soak_e2e.py",
    "tests/e2e/test_soak_component.py",
    "tests/rank_worker/test_model_parity.py",
    "tests/gateway/test_edges_e2e.py",
    "tests/e2e/test_internal_auth_e2e.py",
    "tests/loadgen/test_needle_e2e.py",
    "tests/gateway/test_openai_e2e.py",
    "tests/rank_worker/test_model_files.py",
    "tests/launcher/test_cli.py",
    "tests/rank_worker/test_server.py",
    "tests/gateway/test_deepseek_prompt.py",
    "tests/rank_worker/test_engine_requests.py",
    "tests/gateway/test_bad_input_e2e.py",
    "tests/rank_worker/test_kv_fp8.py",
    "tests/loadgen/test_agents_e2e.py",
)


@pytest.hookimpl(optionalhook=True)  # xdist's hook: absent under -p no:xdist
def pytest_xdist_make_scheduler(config, log):  # type: ignore[no-untyped-def]
    if config.getvalue("dist") != "loadfile":
        return None  # xdist's own choice
    from xdist.scheduler import LoadFileScheduling

    class LongestFilesFirst(LoadFileScheduling):
        def _assign_work_unit(self, node) -> None:  # type: ignore[no-untyped-def]
            for scope in reversed(LONGEST_FILES_FIRST):
                if scope in self.workqueue:
                    self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return LongestFilesFirst(config, log)
