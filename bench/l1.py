"""L1 benchmark: offload (GPU pool -> host arena) and restore (arena -> pool) bandwidth for 64 MB to 4 GB of
KV blocks, against the measured 55 GB/s of pinned host memory; and one 100K-token session restored from
L1 vs recomputed by a cold prefill, in the llama-8b shape.

The arena is a file in /dev/shm mapped and registered with CUDA exactly as a rank maps the kvstore's arena
(rank_worker/l1/arena.py), and blocks move through the rank's own BlockCopier. Blocks are picked at random
in the pool and in the arena (scattered: every block a copy of its own, as a long-running pool looks);
contiguous runs (one copy per run) are reported beside them. The recompute is the engine's own prefill of
the same number of tokens, random weights, timed to the first token.

    python bench/l1.py --out simulator/results/l1-h200.json    # on the H200: the simulator's L1 restore bandwidth
    python bench/l1.py --quick                                 # smoke run on a CPU
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from contracts.config import load_config  # noqa: E402
from loadgen.provenance import checkout_record  # noqa: E402
from rank_worker.engine.factory import build_engine  # noqa: E402
from rank_worker.engine.interface import EngineRequest, SamplingParams  # noqa: E402
from rank_worker.engine.paged_engine import PagedEngine  # noqa: E402
from rank_worker.l1.arena import ArenaLayout, ArenaMapping  # noqa: E402
from rank_worker.l1.block_copier import BlockCopier  # noqa: E402

PINNED_GBPS = 55.0  # host <-> GPU over pinned memory, measured on the H200 (../shared/design/performance.md)
MB = 1_000_000


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class ArenaFile:
    """A shared-memory file of the given size, removed afterwards (what the kvstore creates)."""

    def __init__(self, nbytes: int, directory: str) -> None:
        self.path = os.path.join(directory, f"kvserve-l1-bench-{uuid.uuid4().hex}")
        fd = os.open(self.path, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, nbytes)
        finally:
            os.close(fd)
        self.nbytes = nbytes

    def remove(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)


class L1Bench:
    def __init__(self, engine: PagedEngine, arena_bytes: int, arena_dir: str, seed: int = 0) -> None:
        self.engine = engine
        pool = engine.kv_cache
        self.block_bytes = pool[0].numel() * pool.element_size()
        num_slots = arena_bytes // self.block_bytes
        self.file = ArenaFile(num_slots * self.block_bytes, arena_dir)
        layout = ArenaLayout("bench", self.file.path, self.file.nbytes, self.block_bytes, num_slots)
        started = time.perf_counter()
        self.mapping = ArenaMapping(layout, tuple(pool.shape[1:]), pool.dtype, pin_for_cuda=pool.is_cuda)
        self.register_s = time.perf_counter() - started
        self.copier = BlockCopier(pool, self.mapping.slots)
        self.gen = torch.Generator().manual_seed(seed)
        pool.normal_()  # random data, never zeros
        slots = self.mapping.slots
        seed_rows = min(64, slots.shape[0])
        slots[:seed_rows].normal_()  # the rest repeats these rows: random bytes, without 13 GB of RNG
        for start in range(seed_rows, slots.shape[0], seed_rows):
            rows = min(seed_rows, slots.shape[0] - start)
            slots[start : start + rows].copy_(slots[:rows])

    def close(self) -> None:
        self.copier.synchronize()
        self.mapping.close()
        self.file.remove()

    def pick(self, count: int, scattered: bool) -> tuple[list[int], list[int]]:
        blocks, slots = self.engine.kv_cache.shape[0], self.mapping.slots.shape[0]
        if count > min(blocks, slots):
            raise ValueError(f"{count} blocks do not fit a pool of {blocks} and an arena of {slots}")
        if not scattered:
            return list(range(count)), list(range(count))
        block_ids = torch.randperm(blocks, generator=self.gen)[:count].tolist()
        slot_ids = torch.randperm(slots, generator=self.gen)[:count].tolist()
        return block_ids, slot_ids

    def time_copy(self, direction: str, count: int, scattered: bool, repeats: int) -> float:
        """Median seconds for one batch of `count` blocks, queued and completed."""
        times = []
        for attempt in range(repeats + 1):  # the first is a warm-up
            block_ids, slot_ids = self.pick(count, scattered)
            sync()
            start = time.perf_counter()
            if direction == "offload":
                job = self.copier.offload(block_ids, slot_ids)
            else:
                job = self.copier.restore(slot_ids, block_ids)
            job.wait()
            sync()
            if attempt:
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    def bandwidth(self, sizes: list[int], repeats: int) -> dict[str, list[dict]]:
        result: dict[str, list[dict]] = {"offload": [], "restore": []}
        for direction in ("offload", "restore"):
            for size in sizes:
                count = max(1, size // self.block_bytes)
                nbytes = count * self.block_bytes
                row = {"bytes": nbytes, "blocks": count}
                for scattered in (True, False):
                    seconds = self.time_copy(direction, count, scattered, repeats)
                    key = "" if scattered else "contiguous_"
                    row[f"{key}GBps"] = nbytes / seconds / 1e9
                    row[f"{key}s"] = seconds
                row["of_pinned_peak"] = row["GBps"] / PINNED_GBPS
                result[direction].append(row)
                print(direction, row, flush=True)
        return result

    def session(self, tokens: int, repeats: int) -> dict:
        """One session of `tokens` tokens: restore its blocks from L1 vs recompute its prefill."""
        block_size = self.engine.settings.engine.block_size
        count = tokens // block_size
        restore_s = self.time_copy("restore", count, scattered=True, repeats=repeats)
        recompute = []
        for _ in range(max(1, repeats // 2)):
            prompt = torch.randint(0, self.engine.model.cfg.vocab_size, (tokens,), generator=self.gen).tolist()
            recompute.append(self.cold_prefill_s(prompt))
        recompute_s = statistics.median(recompute)
        row = {
            "tokens": tokens,
            "bytes": count * self.block_bytes,
            "restore_s": restore_s,
            "recompute_s": recompute_s,
            "speedup": recompute_s / restore_s,
        }
        print("session", row, flush=True)
        return row

    def cold_prefill_s(self, prompt: list[int]) -> float:
        engine = self.engine
        engine.pool.clear_cache()  # nothing of it may be cached: a cold prefill
        request_id = f"cold-{uuid.uuid4().hex}"
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        sync()
        start = time.perf_counter()
        engine.add_request(EngineRequest(request_id, prompt, params))
        while engine.has_unfinished():
            engine.step()
        sync()
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-8b")
    parser.add_argument("--quick", action="store_true", help="tiny sizes on any machine: a smoke run")
    parser.add_argument("--out", default="")
    parser.add_argument("--commit", default="", help="commit to record (defaults to git HEAD)")
    parser.add_argument("--arena-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    args = parser.parse_args()

    if args.quick:
        shape, sizes, session_tokens, repeats = "tiny", [1 * MB, 4 * MB], 2048, 2
    else:
        shape, sizes, session_tokens, repeats = args.shape, [64 * MB, 256 * MB, 1000 * MB, 4000 * MB], 100_000, 5
    config = load_config(
        model=str(ROOT / "bench" / "shapes" / shape / "config.json"),
        load_format="dummy",
        max_num_batched_tokens=32768 if not args.quick else 1024,
        max_model_len=session_tokens + 64,
        gpu_memory_utilization=0.85,
        kv_cache_memory_gb=0.25,
    )
    engine = build_engine(config)
    block_bytes = engine.kv_cache[0].numel() * engine.kv_cache.element_size()
    session_bytes = (session_tokens // engine.settings.engine.block_size) * block_bytes
    arena_bytes = max(max(sizes), session_bytes) + 16 * block_bytes
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    bench = L1Bench(engine, arena_bytes, args.arena_dir)
    print(
        f"{gpu}: pool {engine.pool.num_blocks} blocks of {block_bytes / 2**20:.2f} MiB; arena "
        f"{arena_bytes / 1e9:.1f} GB in {args.arena_dir} (pinned: {bench.mapping.pinned}, "
        f"registered in {bench.register_s:.2f} s)",
        flush=True,
    )
    pinned = bench.mapping.pinned  # read before close() unregisters it
    try:
        bandwidth = bench.bandwidth(sizes, repeats)
        session = bench.session(session_tokens, repeats)
    finally:
        bench.close()

    result = {
        "date": dt.date.today().isoformat(),
        **checkout_record(args.commit),
        "gpu": gpu,
        "torch": torch.__version__,
        "shape": shape,
        "dtype": str(engine.kv_cache.dtype).removeprefix("torch."),
        "block_bytes": block_bytes,
        "arena": {"dir": args.arena_dir, "bytes": arena_bytes, "pinned": pinned},
        "pinned_reference_GBps": PINNED_GBPS,
        "restore": bandwidth["restore"],
        "offload": bandwidth["offload"],
        "session_100k" if not args.quick else "session": session,
    }
    print_table(result)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


def print_table(result: dict) -> None:
    print(f"\nL1 copies, {result['shape']} blocks of {result['block_bytes'] / 2**20:.2f} MiB, {result['gpu']}")
    print(f"{'direction':<9} {'MB':>7} {'scattered GB/s':>15} {'contiguous GB/s':>16} {'of 55 GB/s':>11}")
    for direction in ("offload", "restore"):
        for row in result[direction]:
            print(
                f"{direction:<9} {row['bytes'] / MB:>7.0f} {row['GBps']:>15.1f} {row['contiguous_GBps']:>16.1f} "
                f"{row['of_pinned_peak']:>10.0%}"
            )
    session = result.get("session_100k") or result["session"]
    print(
        f"session of {session['tokens']} tokens ({session['bytes'] / 1e9:.1f} GB): "
        f"restore {session['restore_s']:.3f} s, recompute {session['recompute_s']:.2f} s ({session['speedup']:.0f}x)"
    )


if __name__ == "__main__":
    main()
