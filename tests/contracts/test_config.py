from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from contracts.config import load_config


def test_file_then_environment_then_arguments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config_file = tmp_path / "kvserve.yaml"
    config_file.write_text("max_num_seqs: 7\nblock_size: 32\nprefix_cache: false\n")
    monkeypatch.setenv("KVSERVE_CONFIG", str(config_file))
    monkeypatch.setenv("KVSERVE_BLOCK_SIZE", "64")
    config = load_config(max_model_len=1024)
    assert (config.max_num_seqs, config.block_size, config.prefix_cache, config.max_model_len) == (7, 64, False, 1024)


def test_unknown_keys_and_bad_values_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSERVE_CONFIG", raising=False)
    with pytest.raises(ValidationError):
        load_config(max_num_sequences=3)
    with pytest.raises(ValidationError):
        load_config(gpu_memory_utilization=1.5)
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "missing.yaml")
