"""The rank worker's GIL switch interval: the engine thread's longest wait for a GIL a gRPC thread holds."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from contracts.config import KvServeConfig
from rank_worker.main import apply_gil_switch_interval


@pytest.fixture
def interval_restored() -> Iterator[None]:
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_the_rank_worker_shortens_pythons_interval_by_default(interval_restored: None) -> None:
    sys.setswitchinterval(0.005)
    apply_gil_switch_interval(KvServeConfig())
    assert sys.getswitchinterval() == pytest.approx(0.0005)


def test_a_set_interval_is_applied_and_none_leaves_pythons(interval_restored: None) -> None:
    apply_gil_switch_interval(KvServeConfig(gil_switch_interval_ms=2.0))
    assert sys.getswitchinterval() == pytest.approx(0.002)
    sys.setswitchinterval(0.005)
    apply_gil_switch_interval(KvServeConfig(gil_switch_interval_ms=None))
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_the_interval_is_bounded() -> None:
    for bad in (0.0, -1.0, 1000.0):
        with pytest.raises(ValueError, match="gil_switch_interval_ms"):
            KvServeConfig(gil_switch_interval_ms=bad)
