"""Shared pieces for L1 tests: a real kvstore process, engines linked to it, and a tiny random model for
tests that need many steps rather than real text.

gRPC is imported only where it is used, so CUDA tests can run where only torch is installed."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from engine_fixtures import engine_settings

from rank_worker.engine.interface import TokenizerBundle
from rank_worker.engine.paged_engine import PagedEngine
from rank_worker.model.config import LlamaFamilyConfig
from rank_worker.model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from protos import kvstore_pb2

TINY_MODEL = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 512,
}


def tiny_model(device: str = "cpu", max_positions: int = 512) -> LlamaForCausalLM:
    """Random float32 weights of a 2-layer model: thousands of steps per second on the CPU. max_positions: its
    rotary table (bench/probes/l1_agents_cpu.py --max-context runs longer sessions)."""
    config = LlamaFamilyConfig.from_hf(TINY_MODEL | {"max_position_embeddings": max(512, max_positions)})
    with torch.device(device):
        model = LlamaForCausalLM(config, max_positions=max_positions)
    model.init_random_weights(0)
    return model.eval()


def kvstore_settings(arena_dir: Path) -> dict[str, str]:
    """A 50 MB arena in the test's own folder."""
    return {"KVSERVE_L1_HOST_GB": "0.05", "KVSERVE_L1_ARENA_DIR": str(arena_dir), "KVSERVE_L1_HEADROOM_GB": "0"}


def kvstore_stats(port: int) -> kvstore_pb2.StatsResponse:
    from contracts import internal_auth
    from protos import kvstore_pb2 as kvstore_pb
    from protos import kvstore_pb2_grpc as kvstore_grpc

    with internal_auth.channel(f"127.0.0.1:{port}") as channel:
        return kvstore_grpc.KvStoreStub(channel).Stats(kvstore_pb.StatsRequest(), timeout=10)


def l1_engine(
    model: LlamaForCausalLM,
    tokenizer: TokenizerBundle | None,
    kvstore_port: int,
    retry_interval_s: float = 0.5,
    link_class: type | None = None,
    **settings: object,
) -> PagedEngine:
    """An engine whose L1 tier talks to the kvstore on kvstore_port (short deadlines, as in production), through
    link_class (a KvStoreLink, or a subclass that records the calls)."""
    from rank_worker.l1.kvstore_link import KvStoreLink

    values: dict[str, object] = {"num_blocks": 20, "block_size": 16, "max_model_len": 320}
    values.update(settings)
    link = (link_class or KvStoreLink)(f"127.0.0.1:{kvstore_port}", f"rank-test-{kvstore_port}", uuid.uuid4().hex)
    return PagedEngine(
        model,
        engine_settings(**values),
        tokenizer,
        l1_client=link,
        l1_retry_interval_s=retry_interval_s,
    )
