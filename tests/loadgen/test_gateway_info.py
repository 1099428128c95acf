"""loadgen.gateway_info's /metrics read when the gateway refuses it: zeros, and a warning that says why."""

from __future__ import annotations

import httpx
import pytest

from loadgen import gateway_info


def test_a_refused_metrics_read_warns_once_and_reads_zero(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    monkeypatch.setattr(gateway_info, "_warned_metrics_refused", False)
    refusing = httpx.MockTransport(lambda request: httpx.Response(403, json={"type": "error"}))
    with httpx.Client(transport=refusing, base_url="http://gateway") as client:
        assert gateway_info.cached_tokens_by_tier(client) == {"l0": 0.0, "l1": 0.0}
        assert gateway_info.cached_tokens_by_tier(client) == {"l0": 0.0, "l1": 0.0}
    err = capsys.readouterr().err
    assert err.count("warning: the gateway answered /metrics with 403") == 1 and "--metrics" in err
