"""The agent benchmark's stack configs (bench/configs/) load as `kvserve up` loads them, and one that pays back
overruns to decoders leaves them headroom under the load generator's per-agent bar."""

from pathlib import Path

import pytest

from contracts.config import load_config
from loadgen.report import Thresholds

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "bench" / "configs").glob("*.yaml"))


def test_there_are_bench_configs() -> None:
    assert {path.name for path in CONFIGS} >= {"agents-h200.yaml", "agents-dsv2-lite-h200.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.name)
def test_a_bench_config_loads_and_its_payback_budget_clears_the_bar(path: Path) -> None:
    config = load_config(path)
    scheduling = config.scheduling
    if scheduling.decode_payback:
        # with payback the decoders average at most one token per budget (scheduler.payback)
        assert 1000 / scheduling.step_budget_ms(cuda=True) > Thresholds().tok_s_p50 * 1.1
