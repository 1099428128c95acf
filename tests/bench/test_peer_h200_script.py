"""bench/peer_h200.sh run here (the GPU not needed): its compile caches (`caches-out` sends a machine's caches back in
parts, and the `chunk` calls of a later lease unpack them once every part has come, never a partial set), and the
one step budget it gives both servers, and flash-attn 4 taken up by the very call that brings its last chunk."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "peer_h200.sh"


def phase(name: str, cwd: Path, home: Path, tmp: Path, **more: str) -> str:
    env = {
        **os.environ,
        **more,
        "HOME": str(home),
        "OUT": str(tmp / "out"),
        "PEER_STATE": str(tmp / "state"),
        "PEER_WORK": str(tmp / "work"),
        "CACHE_ACC": str(tmp / "acc"),
        "FA4_ACC": str(tmp / "fa4acc"),
        "FA4_SITE": str(tmp / "fa4site"),
    }
    done = subprocess.run(
        ["bash", str(SCRIPT), *name.split()], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


@pytest.mark.skipif(shutil.which("split") is None or shutil.which("gzip") is None, reason="needs split and gzip")
def test_caches_come_back_in_parts_and_unpack_only_whole(tmp_path: Path) -> None:
    lease_one, lease_two = tmp_path / "home-one", tmp_path / "home-two"
    blob = os.urandom(20_000_000)  # incompressible: two 15 MB parts
    (lease_one / ".cache" / "vllm" / "torch_compile_cache").mkdir(parents=True)
    (lease_one / ".cache" / "vllm" / "torch_compile_cache" / "graph").write_bytes(blob)
    (lease_one / ".triton" / "cache").mkdir(parents=True)
    (lease_one / ".triton" / "cache" / "fused_moe.cubin").write_bytes(b"kernel")
    lease_two.mkdir()
    said = phase("caches-out", tmp_path, lease_one, tmp_path / "one")
    parts = sorted((tmp_path / "one" / "out").glob("caches.part*"))
    assert [p.name for p in parts] == ["caches.part00", "caches.part01"], said
    assert all(p.stat().st_size <= 16 * 2**20 for p in parts)  # what one call may send back a file

    tree = tmp_path / "tree"  # the working tree of a later lease: the parts carried into .caches/, one a call
    (tree / ".caches").mkdir(parents=True)
    shutil.copy(parts[0], tree / ".caches")
    said = phase("chunk", tree, lease_two, tmp_path / "two")
    assert "do not make a whole tarball" in said
    assert not any(lease_two.iterdir())  # nothing of a partial set unpacked
    shutil.copy(parts[1], tree / ".caches")
    said = phase("chunk", tree, lease_two, tmp_path / "two")
    assert "compile caches restored" in said
    assert (lease_two / ".cache" / "vllm" / "torch_compile_cache" / "graph").read_bytes() == blob
    assert (lease_two / ".triton" / "cache" / "fused_moe.cubin").read_bytes() == b"kernel"
    assert "compile caches restored" not in phase("chunk", tree, lease_two, tmp_path / "two")  # once


def test_caches_out_on_a_machine_without_caches_sends_nothing(tmp_path: Path) -> None:
    (tmp_path / "home").mkdir()
    said = phase("caches-out", tmp_path, tmp_path / "home", tmp_path / "run")
    assert "no compile caches" in said
    assert not list((tmp_path / "run").rglob("caches.part*"))


def test_both_servers_get_one_step_budget(tmp_path: Path) -> None:
    said = phase("status", tmp_path, tmp_path, tmp_path)
    assert "step budget: vllm serve 32768; kvserve up 32768 (KVSERVE_MAX_NUM_BATCHED_TOKENS=32768)" in said
    assert '"diff_sha256"' in (tmp_path / "work" / "provenance.json").read_text()  # every call records its code
    said = phase("status", tmp_path, tmp_path, tmp_path, VLLM_MAX_BATCHED="16384")
    assert "kvserve up 16384 (KVSERVE_MAX_NUM_BATCHED_TOKENS=16384)" in said
    said = phase("status", tmp_path, tmp_path, tmp_path, VLLM_MAX_BATCHED="0")  # vLLM's default: ours its config's
    assert "step budget: vllm serve its default; kvserve up its config's ()" in said


def test_a_call_that_brings_the_last_fa4_chunk_runs_our_stack_with_it(tmp_path: Path) -> None:
    # On 2026-12-06 `chunk ours-agents` set its environment before the chunk phase copied .fa4/chunk01, and the rank
    # ran MLA prefill through SDPA (40 s steps). The site stands installed here: what is tested is the order.
    tree, run = tmp_path / "tree", tmp_path / "run"
    (tree / ".fa4").mkdir(parents=True)
    (run / "fa4site" / "flash_attn" / "cute").mkdir(parents=True)
    (run / "fa4site" / "flash_attn" / "cute" / "__init__.py").write_text("")
    (tree / ".fa4" / "chunk01").write_bytes(b"the last chunk, carried by this call")
    assert "flash-attn 4 for our prefill: off" in phase("status", tree, tmp_path, run)  # no chunk on the machine yet
    said = phase("chunk status", tree, tmp_path, run)
    assert "flash-attn 4 for our prefill: on" in said


def test_stop_stops_the_servers_of_every_peer_tag(tmp_path: Path) -> None:
    # On 2026-12-06 our stack, left up for its next step under PEER_TAG=llama-l1x80, still answered on the port when
    # vLLM's call (PEER_TAG=llama-off80) came: that call's stop and start looked only at their own tag's pidfile.
    servers = []
    for state, side in (("state-llama-l1x80", "ours"), ("state", "vllm"), ("state-llama-off80", "vllm")):
        server = subprocess.Popen(  # its own session, as the script's are; SIGINT ends it (an xdist worker ignores it)
            ["sleep", "300"], start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)
        )
        # reaped the moment it ends (a zombie would still answer the script's `kill -0`)
        threading.Thread(target=server.wait, daemon=True).start()
        servers.append(server)
        (tmp_path / state).mkdir(exist_ok=True)
        (tmp_path / state / f"{side}.pid").write_text(f"{server.pid}\n")
    try:
        said = phase("stop", tmp_path, tmp_path, tmp_path)
        for server in servers:
            assert server.poll() is not None, said  # each is gone, not only this tag's
        assert f"stopping kvserve ({tmp_path}/state-llama-l1x80/ours.pid)" in said
        assert f"stopping vllm serve ({tmp_path}/state-llama-off80/vllm.pid)" in said
    finally:
        for server in servers:
            server.kill()
            server.wait()


def test_sim_calibrate_probes_decode_against_this_machines_engine_run(tmp_path: Path) -> None:
    """The phase runs the decode probe against the engine JSON an ours-engine call left on this machine, and sends
    its rows back; here on the tiny shape with a pool too small for any case, so every case is skipped quickly."""
    repo = SCRIPT.parents[1]
    (tmp_path / "work").mkdir()
    shutil.copy(repo / "simulator" / "results" / "engine-h200.json", tmp_path / "work" / "ours-engine.json")
    said = phase(
        "sim-calibrate", tmp_path, tmp_path, tmp_path,
        ENGINE_SHAPE="tiny", PROBE_BLOCKS="64", PYTHON=sys.executable, PYTHONPATH=str(repo),
    )  # fmt: skip
    assert f"(model: {tmp_path / 'work' / 'ours-engine.json'})" in said
    assert "skipped: 1 x 4096 tokens" in said
    probe = json.loads((tmp_path / "out" / "decode-probe.json").read_text())
    assert probe["shape"] == "tiny" and probe["rows"] == []
