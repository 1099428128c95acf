"""`kvserve bench simulate` end to end on a small trace file: predicted steps, the largest passing N and its
cost, calibration against a measured run (whose workload settings it adopts), the A/B of both policies,
bad arguments; and the pieces it is made of (pool sizing, cost, predicted/measured ratios)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.cli import main as kvserve
from simulator.calibration import compare_steps
from simulator.capacity import SECONDS_PER_MONTH, cost_per_million_input_tokens
from simulator.cli import main
from simulator.kv_capacity import kv_pool_blocks, shape_facts

REPO = Path(__file__).resolve().parents[2]
LLAMA_CHAT_SHAPE = REPO / "bench" / "shapes" / "llama-8b-chat" / "config.json"


def _trace_file(directory: Path, sessions: int = 4, turns: int = 12) -> Path:
    """Claude Code traces (the real format, made up numbers): 12K-token sessions growing 256 tokens a call."""
    directory.mkdir()
    for s in range(sessions):
        requests = []
        for turn in range(turns):
            blocks = 190 + 4 * turn
            requests.append(
                {"t": 5.0 * turn, "type": "s", "in": blocks * 64, "out": 30, "hash_ids": list(range(1, blocks + 1))}
            )
        data = {"id": f"trace_{s + 1:04d}", "block_size": 64, "requests": requests}
        with gzip.open(directory / f"trace_{s + 1:04d}.json.gz", "wt") as f:
            json.dump(data, f)
    return directory


def test_simulate_predicts_steps_the_largest_passing_n_and_its_cost(tmp_path: Path) -> None:
    traces = _trace_file(tmp_path / "traces")
    out = tmp_path / "sim.json"
    args = ["--trace-path", str(traces), "--agents", "2,4", "--turns", "12", "--think-time", "2"]
    assert main([*args, "--monthly-price", "20000", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["simulated"] is True and results["shape"] == "llama-8b"
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    # what ran: the checkout's commit and, where the tree has uncommitted changes, their hash (loadgen/provenance.py)
    assert results["commit"] == head and results["provenance"]["commit"] == head
    assert set(results["provenance"]) == {"commit", "diff_sha256", "dirty"}
    assert results["kv_blocks_per_rank"] == 52470  # the pool the engine benchmark measured
    assert [step["agents"] for step in results["steps"]] == [2, 4]
    for step in results["steps"]:
        assert step["requests"] == step["agents"] * 12 and step["errors"] == 0
        assert step["cache_hit"] > 0.9  # 12 calls resending their session: only the first is cold
    assert results["largest_passing"] == 4
    step = results["steps"][1]
    assert results["cost_per_million_input_tokens"] == pytest.approx(
        20000 / (step["input_tokens_per_s"] * SECONDS_PER_MONTH / 1e6), rel=1e-3
    )
    assert results["decode_results"].endswith("simulator/results/decode-h200.json")  # used by default
    fit = results["step_time_fit"]
    assert len(fit) == 29 and all(row["model_s"] == pytest.approx(row["measured_s"], rel=0.2) for row in fit)


def test_calibrate_replays_the_measured_run_and_reports_ratios(tmp_path: Path) -> None:
    traces = _trace_file(tmp_path / "traces")
    measured = tmp_path / "agents-h200.json"
    measured.write_text(
        json.dumps(
            {
                "workload": {"trace": "claude_code", "trace_path": str(traces), "synthetic": None},
                "context_scale": 0.5,
                "think_time": "2",
                "turns": 6,
                "duration_s": 300.0,
                "steps": [
                    {"agents": 2, "ttft_p50": 0.5, "ttft_p95": 2.0, "tok_s_p50": 30.0, "cache_hit": 0.8},
                    {"agents": 3, "ttft_p50": 0.6, "ttft_p95": 2.5, "tok_s_p50": 25.0, "cache_hit": 0.8},
                ],
            }
        )
    )
    out = tmp_path / "calibrated.json"
    # Through the kvserve command, as the README will show it.
    assert kvserve(["bench", "simulate", "--calibrate", str(measured), "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["context_scale"] == 0.5 and results["turns"] == 6  # the measured run's workload
    assert [step["agents"] for step in results["steps"]] == [2, 3]
    rows = results["calibration"]["steps"]
    assert [row["agents"] for row in rows] == [2, 3]
    for row, step in zip(rows, results["steps"], strict=True):
        assert row["ttft_p95"]["predicted"] == step["ttft_p95"]
        assert row["ttft_p95"]["ratio"] == pytest.approx(step["ttft_p95"] / row["ttft_p95"]["measured"], abs=1e-3)
        assert row["cache_hit"]["ratio"] == pytest.approx(step["cache_hit"] / 0.8, abs=1e-3)


def test_ab_runs_both_policies(tmp_path: Path) -> None:
    traces = _trace_file(tmp_path / "traces", sessions=2, turns=3)
    out = tmp_path / "ab.json"
    assert main(["--trace-path", str(traces), "--agents", "2", "--turns", "3", "--ab", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert set(results["ab"]) == {"fifo", "warm_first"}
    assert results["steps"] == results["ab"]["warm_first"]  # the default policy's steps are the headline


def test_calls_puts_every_call_with_its_l1_tokens_in_the_json(tmp_path: Path) -> None:
    traces = _trace_file(tmp_path / "traces", sessions=2, turns=3)
    out = tmp_path / "calls.json"
    args = ["--trace-path", str(traces), "--agents", "2", "--turns", "3", "--l1-gb", "1", "--json", str(out)]
    assert main([*args, "--calls"]) == 0
    step = json.loads(out.read_text())["steps"][0]
    assert len(step["calls"]) == step["requests"] == 6
    assert {"agent", "turn", "sent_s", "cached_tokens", "l1_cached_tokens"} <= set(step["calls"][0])
    assert sum(call["l1_cached_tokens"] for call in step["calls"]) == step["l1_cached_tokens"]
    assert main(args) == 0
    assert "calls" not in json.loads(out.read_text())["steps"][0]  # only when asked: a step's JSON stays small


def test_bad_arguments_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    traces = _trace_file(tmp_path / "traces", sessions=1, turns=2)
    assert main(["--trace-path", str(traces), "--agents", "0,2"]) == 2
    assert main(["--trace-path", str(tmp_path / "absent"), "--agents", "2"]) == 2
    assert main(["--trace-path", str(traces), "--shape", "no-such-shape"]) == 2
    assert main(["--calibrate", str(tmp_path / "absent.json")]) == 2
    assert main(["--trace-path", str(traces), "--decode-results", str(tmp_path / "absent.json")]) == 2
    err = capsys.readouterr().err
    assert "positive counts" in err and "no model shape" in err


def test_pool_cost_and_ratio_arithmetic() -> None:
    facts = shape_facts("llama-8b")
    assert facts.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2  # 128 KiB: GQA, bf16
    # The H200's measured pool was 52,470 blocks at gpu_memory_utilization 0.9.
    assert kv_pool_blocks(facts, 150.0, 0.9, 9.0, 16) == pytest.approx(52470, rel=0.01)
    with pytest.raises(ValueError):
        kv_pool_blocks(facts, 16.0, 0.9, 9.0, 16)
    assert cost_per_million_input_tokens(20_000, 10_000) == pytest.approx(20_000 / (10_000 * SECONDS_PER_MONTH / 1e6))
    assert cost_per_million_input_tokens(20_000, 0) is None
    rows = compare_steps(
        [{"agents": 4, "ttft_p95": 3.0, "passed": True}, {"agents": 8, "ttft_p95": 9.0}],
        [{"agents": 4, "ttft_p95": 2.0, "passed": False}, {"agents": 16, "ttft_p95": 20.0}],
    )
    assert rows == [
        {
            "agents": 4,
            "ttft_p95": {"measured": 2.0, "predicted": 3.0, "ratio": 1.5},
            "passed": {"measured": False, "predicted": True, "ratio": None},
        }
    ]


def test_the_node_comes_from_the_stacks_config(tmp_path: Path) -> None:
    traces = _trace_file(tmp_path / "traces", sessions=2, turns=3)
    config = tmp_path / "stack.yaml"
    config.write_text(
        f"model: {LLAMA_CHAT_SHAPE}\nload_format: dummy\nmax_model_len: 65536\nmax_num_seqs: 8\n"
        "max_num_batched_tokens: 8192\nl1_host_gb: 2\nscheduling_policy: fifo\nmax_cold_prefills: 2\n"
        "decode_payback: false\n"
    )
    out = tmp_path / "node.json"
    args = ["--config", str(config), "--trace-path", str(traces), "--agents", "2", "--turns", "3"]
    assert main([*args, "--max-num-seqs", "4", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["shape"] == "llama-8b-chat" and results["policy"] == "fifo"
    assert results["rank"]["max_num_seqs"] == 4  # the command line wins over the config
    assert results["rank"]["max_num_batched_tokens"] == 8192 and results["rank"]["max_model_len"] == 65536
    assert results["scheduling"]["max_cold_prefills"] == 2
    assert results["scheduling"]["decode_payback"] is False  # the config's, over the default
    assert results["l1_blocks"] == int(2e9 // (128 * 1024 * 16))
    # A smaller vocabulary than llama-8b's leaves more room for KV than the measured pool.
    assert results["kv_blocks_per_rank"] > 52470


def test_decode_payback_from_the_command_line_wins_over_the_config(tmp_path: Path) -> None:
    traces = _trace_file(tmp_path / "traces", sessions=2, turns=3)
    config = tmp_path / "stack.yaml"
    config.write_text(f"model: {LLAMA_CHAT_SHAPE}\nload_format: dummy\ndecode_payback: false\n")
    out = tmp_path / "node.json"
    args = ["--config", str(config), "--trace-path", str(traces), "--agents", "2", "--turns", "3", "--json", str(out)]
    assert main([*args, "--decode-payback"]) == 0
    assert json.loads(out.read_text())["scheduling"]["decode_payback"] is True
    assert main(args[2:]) == 0  # no config: the config's default (on)
    assert json.loads(out.read_text())["scheduling"]["decode_payback"] is True
    assert main([*args[2:], "--no-decode-payback"]) == 0
    assert json.loads(out.read_text())["scheduling"]["decode_payback"] is False


@pytest.mark.parametrize("tool", ["simulate", "agents"])
def test_the_installed_command_runs_outside_the_repository(tmp_path: Path, tool: str) -> None:
    # The console script's sys.path holds the installed packages, not the checkout: a module outside them
    # (the simulator once imported bench/model_cost.py) fails there and nowhere in-process.
    script = Path(sys.executable).parent / "kvserve"
    if not script.exists():
        pytest.skip("kvserve is not installed beside this interpreter")
    result = subprocess.run(
        [str(script), "bench", tool, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "--agents" in result.stdout
