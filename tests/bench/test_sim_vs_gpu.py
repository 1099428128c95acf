"""bench/sim_vs_gpu.py: a measured step and the simulator's replay of it, joined call by call."""

from __future__ import annotations

import gzip
import json

import pytest

from bench import sim_vs_gpu


def _gpu_call(agent, turn, sent, prompt, cached, ttft, warm=True):
    return {
        "agent": agent,
        "turn": turn,
        "sent_s": sent,
        "warm": warm,
        "input_tokens": prompt,
        "cached_tokens": cached,
        "ttft_s": ttft,
        "error": None,
    }


def _sim_call(agent, turn, sent, cached, l1, ttft):
    return {"agent": agent, "turn": turn, "sent_s": sent, "cached_tokens": cached, "l1_cached_tokens": l1,
            "ttft_s": ttft, "error": None}  # fmt: skip


def _line(prompt, l0, l1):
    return (
        "2026-12-07 14:50:40,000 INFO rank_worker.servicer: finished request=chatcmpl-x reason=length "
        f"prompt_tokens={prompt} l0_cached_tokens={l0} l1_cached_tokens={l1} output_tokens=64\n"
    )


GPU = {
    "steps": [{"agents": 3}],
    "requests": [
        _gpu_call(0, 0, 2.0, 30_000, 0, 10.0, warm=False),
        _gpu_call(1, 1, 5.0, 8_000, 7_000, 0.3),  # the same split on both sides
        _gpu_call(2, 1, 25.0, 12_000, 11_500, 0.6),  # all from L1 here, from L0 in the simulator
        _gpu_call(2, 2, 31.0, 13_000, 12_000, 0.5),  # not in the simulator's JSON: left out
    ],
}
LOG = _line(30_000, 0, 0) + _line(8_000, 7_000, 0) + _line(12_000, 0, 11_500) + _line(13_000, 12_000, 0)
SIM = {
    "steps": [
        {
            "agents": 3,
            "calls": [
                _sim_call(0, 0, 0.0, 0, 0, 20.0),
                _sim_call(1, 1, 4.0, 7_000, 0, 0.2),
                _sim_call(2, 1, 22.0, 11_500, 0, 0.2),
            ],
        }
    ]
}


def test_calls_are_joined_by_agent_and_turn_and_the_first_parting_is_found():
    result = sim_vs_gpu.compare(GPU, LOG, SIM, width_s=10.0, min_tokens=2_000)
    assert result["calls"] == 3 and result["calls_with_split"] == 3
    assert result["totals"] == {"gpu_l0": 7_000, "gpu_l1": 11_500, "sim_l0": 18_500, "sim_l1": 0}
    assert [(w["from_s"], w["calls"], w["gpu_l1"], w["sim_l0"]) for w in result["windows"]] == [
        (0.0, 2, 0, 7_000),
        (20.0, 1, 11_500, 11_500),
    ]
    assert [(row["agent"], row["turn"], row["gpu_l0"], row["sim_l0"]) for row in result["parted"]] == [
        (2, 1, 0, 11_500)
    ]
    cold = result["cold_ttft"]
    assert (cold["calls"], cold["gpu_p50"], cold["sim_p50"], cold["sim_over_gpu_median"]) == (1, 10.0, 20.0, 2.0)


def test_the_command_reads_a_gzipped_log_and_writes_its_json(tmp_path):
    paths = {name: tmp_path / name for name in ("gpu.json", "rank.log.gz", "sim.json", "out.json")}
    paths["gpu.json"].write_text(json.dumps(GPU))
    paths["sim.json"].write_text(json.dumps(SIM))
    with gzip.open(paths["rank.log.gz"], "wt") as handle:
        handle.write(LOG)
    argv = [str(paths[n]) for n in ("gpu.json", "rank.log.gz", "sim.json")] + ["--json", str(paths["out.json"])]
    assert sim_vs_gpu.main(argv) == 0
    assert json.loads(paths["out.json"].read_text())["parted"][0]["sim_l0"] == 11_500


def test_a_simulator_json_without_calls_is_refused():
    with pytest.raises(SystemExit, match="--calls"):
        sim_vs_gpu.compare(GPU, LOG, {"steps": [{"agents": 3}]}, width_s=10.0, min_tokens=2_000)
