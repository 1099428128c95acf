from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from contracts.config import KvServeConfig, load_config


def test_file_then_environment_then_arguments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config_file = tmp_path / "kvserve.yaml"
    config_file.write_text("max_num_seqs: 7\nblock_size: 32\nprefix_cache: false\n")
    monkeypatch.setenv("KVSERVE_CONFIG", str(config_file))
    monkeypatch.setenv("KVSERVE_BLOCK_SIZE", "64")
    config = load_config(max_model_len=1024)
    engine = config.engine
    assert (engine.max_num_seqs, engine.block_size, engine.prefix_cache, config.max_model_len) == (7, 64, False, 1024)


def test_unknown_keys_and_bad_values_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSERVE_CONFIG", raising=False)
    with pytest.raises(ValidationError):
        load_config(max_num_sequences=3)
    with pytest.raises(ValidationError):
        load_config(gpu_memory_utilization=1.5)
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "missing.yaml")


def test_the_scheduling_section_takes_flat_and_nested_keys_in_the_usual_precedence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config_file = tmp_path / "kvserve.yaml"
    config_file.write_text("max_cold_prefills: 3\nscheduling_policy: fifo\nscheduling:\n  warm_prefix_fraction: 0.7\n")
    monkeypatch.setenv("KVSERVE_CONFIG", str(config_file))
    monkeypatch.setenv("KVSERVE_MAX_COLD_PREFILLS", "5")
    monkeypatch.setenv("KVSERVE_DECODE_PAYBACK", "false")  # its default is true
    config = load_config(cold_max_wait_secs=7.0)
    scheduling = config.scheduling
    assert (scheduling.scheduling_policy, scheduling.warm_prefix_fraction) == ("fifo", 0.7)  # the file's
    assert (scheduling.max_cold_prefills, scheduling.decode_payback) == (5, False)  # the environment's
    assert scheduling.cold_max_wait_secs == 7.0  # the argument's
    assert load_config(max_cold_prefills=1).scheduling.max_cold_prefills == 1
    assert KvServeConfig.model_validate({"min_prefill_chunk_tokens": 64}).scheduling.min_prefill_chunk_tokens == 64
    monkeypatch.delenv("KVSERVE_CONFIG")
    with pytest.raises(ValueError, match="given both flat and under scheduling"):
        load_config(max_cold_prefills=1, scheduling={"max_cold_prefills": 2})
    with pytest.raises(ValidationError):
        load_config(max_cold_prefills=-1)


def test_the_engine_section_takes_flat_and_nested_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSERVE_CONFIG", raising=False)
    monkeypatch.setenv("KVSERVE_CUDA_GRAPHS", "false")
    config = load_config(engine={"max_num_seqs": 3}, block_size=32)
    assert (config.engine.max_num_seqs, config.engine.block_size, config.engine.cuda_graphs) == (3, 32, False)
    assert KvServeConfig.model_validate({"num_kv_blocks": 9}).engine.num_kv_blocks == 9
    assert config.engine.l1_offload_bytes_per_step == 512 << 20
    with pytest.raises(ValueError, match="given both flat and under engine"):
        load_config(max_num_seqs=1, engine={"max_num_seqs": 2})
    with pytest.raises(ValidationError, match="at least 16"):
        load_config(max_num_batched_tokens=8)
