"""The needle gate against the real stack (rank worker with the embedded SmolLM2 + gateway) at one 4K length:
the cached answer must be the cold one, and the warm request must really have been served from cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from service_processes import gateway_stack

from loadgen.needle_cli import main


def test_needle_gate_passes_on_the_embedded_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rank = {"KVSERVE_MAX_MODEL_LEN": "8192", "KVSERVE_NUM_KV_BLOCKS": "1024", "KVSERVE_MAX_NUM_SEQS": "4"}
    out = tmp_path / "needle.json"
    with gateway_stack(tmp_path, rank, {}) as url:
        code = main(["--url", url, "--lengths", "4096", "--json", str(out), "--timeout", "300"])
    report = json.loads(out.read_text())
    assert code == 0, report["failures"]
    assert report["passed"] and report["skipped"] == []
    [entry] = report["lengths"]
    assert entry["length"] == 4096
    assert 0.97 * 4096 <= entry["prompt_tokens"] <= 4096 - 16  # fitted by the gateway's own token count
    cold, warm = entry["cold"], entry["warm"]
    assert entry["match"] and cold["text"] == warm["text"] and cold["text"]
    assert cold["cache_hit"] < 0.1  # the nonce made the document new to the cache
    assert warm["cache_hit"] > 0.9
    assert cold["input_tokens"] + cold["cache_read_input_tokens"] == entry["prompt_tokens"]
    assert warm["input_tokens"] + warm["cache_read_input_tokens"] == entry["prompt_tokens"]
    assert "PASS" in capsys.readouterr().out
