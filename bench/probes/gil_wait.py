"""Probe: how long the engine thread waits for the GIL behind the rank worker's gRPC threads, on the CPU.

In the serving process the engine thread spends most of a GPU decode step waiting for the GPU with the GIL
let go, while the gRPC threads turn the last step's tokens into stream messages. When the GPU is done the
engine thread needs the GIL back; if a gRPC thread holds it, CPython lets it wait up to the switch interval
(5 ms by default) before forcing a hand-over. This probe reproduces that regime without a GPU: a real rank
worker servicer and engine loop in this process (the engine's own Python, its scheduler, inputs and outputs
all real), with a model that "runs on the GPU" by sleeping (which lets the GIL go) for --gpu-ms per step,
and a client in another process streaming --streams requests. A step's wall time above --gpu-ms is host
time: the engine's own work plus its waits for the GIL. The switch interval is process-wide: each one is set
before its own server starts.

    python bench/probes/gil_wait.py --intervals default,1,0.5,0.2 \
        --out bench/results/2026-12-01-cpu-gil-wait/gil-wait.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.probes.host_step import TINY, VOCAB, write_rows  # noqa: E402

PROMPT_TOKENS = 64


class SleepingModel(torch.nn.Module):
    """Logits after `gpu_s` of GIL-free waiting: the host's view of a forward that runs on the GPU."""

    def __init__(self, gpu_s: float) -> None:
        super().__init__()
        self.gpu_s = gpu_s
        self.cfg = types.SimpleNamespace(vocab_size=VOCAB)

    def forward(self, batch, kv_cache):  # type: ignore[no-untyped-def]
        time.sleep(self.gpu_s)
        return torch.zeros(batch.logits_indices.shape[0], VOCAB)


async def serve_and_measure(args: argparse.Namespace, interval: str) -> dict:
    import grpc

    from contracts.config import load_config
    from protos import rank_worker_pb2_grpc
    from rank_worker.engine.decode_graphs import DecodeGraphs
    from rank_worker.engine.factory import build_engine
    from rank_worker.engine_loop import EngineLoop
    from rank_worker.servicer import RankWorkerServicer

    sys.setswitchinterval(0.005 if interval == "default" else float(interval) / 1000.0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(TINY))
        config = load_config(
            model=str(path), load_format="dummy", dtype="float32", max_num_seqs=max(args.streams, 8), max_model_len=2048
        )
        engine = build_engine(config)
    runner = engine.runner
    runner.model = SleepingModel(args.gpu_ms / 1000.0)
    rows = max(args.streams, 8)
    runner.decode_graphs = DecodeGraphs(runner.model, engine.kv_cache, runner.inputs, rows, capture=False)
    loop = EngineLoop(engine, timing_log_interval_s=3600.0)
    loop.start()
    servicer = RankWorkerServicer(1024)
    servicer.attach(loop, engine.model_info, "probe")
    server = grpc.aio.server()  # no internal auth: the client is this probe's own child
    rank_worker_pb2_grpc.add_RankWorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--client",
        str(port),
        "--streams",
        str(args.streams),
        "--tokens",
        str(args.tokens),
        stdout=subprocess.PIPE,
    )
    out, _ = await client.communicate()
    result = json.loads(out.decode().strip().splitlines()[-1])
    await server.stop(0)
    loop.stop()
    return {
        "switch_interval_ms": 5.0 if interval == "default" else float(interval),
        "streams": args.streams,
        "gpu_ms": args.gpu_ms,
        **result,
        "host_ms": round(result["step_ms"] - args.gpu_ms, 3),
    }


async def client(port: int, streams: int, tokens: int) -> None:
    import grpc

    from protos import rank_worker_pb2 as pb
    from protos import rank_worker_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.RankWorkerStub(channel)

        async def one(i: int, count: int) -> int:
            prompt = [(i * 7 + j) % 1000 + 5 for j in range(PROMPT_TOKENS)]
            sampling = pb.SamplingParams(max_tokens=count, ignore_eos=True)
            request = pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling)
            n = 0
            async for response in stub.Generate(request, timeout=600):
                if response.HasField("tokens"):
                    n += len(response.tokens.token_ids)
            return n

        await asyncio.gather(*(one(i, 4) for i in range(4)))
        started = time.perf_counter()
        counts = await asyncio.gather(*(one(i, tokens) for i in range(streams)))
        wall = time.perf_counter() - started
    steps = tokens  # every stream decodes together: about one step per token
    print(json.dumps({"tokens_per_s": round(sum(counts) / wall, 1), "step_ms": round(wall / steps * 1e3, 3)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--intervals", default="default,1,0.5,0.2", help="switch intervals in ms; default = 5")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--gpu-ms", type=float, default=12.0, help="the sleeping model's step")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--client", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.client:
        asyncio.run(client(args.client, args.streams, args.tokens))
        return
    torch.set_num_threads(1)
    rows = []
    for _ in range(args.repeats):
        for interval in args.intervals.split(","):
            row = asyncio.run(serve_and_measure(args, interval))
            rows.append(row)
            print(
                f"switch interval {row['switch_interval_ms']:4.1f} ms: step {row['step_ms']:.2f} ms for a "
                f"{args.gpu_ms:g} ms GPU step ({row['step_ms'] - args.gpu_ms:.2f} ms host), "
                f"{row['tokens_per_s']:.0f} tok/s over {args.streams} streams",
                flush=True,
            )
    write_rows(args.out, "gil_wait", rows)


if __name__ == "__main__":
    main()
