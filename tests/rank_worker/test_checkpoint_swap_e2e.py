"""A checkpoint rewritten in place under a running kvstore never reads the old checkpoint's KV from L1.

Real processes: a kvstore and a rank worker serving checkpoint A, which fills L1; the rank restarted on A
restores the prompt from L1 (so this setup can restore across restarts); then the directory is rewritten
with checkpoint B (same path, name, tokenizer, config and tensor shapes; other weights) and the rank
restarted on it: the same prompt is computed, not restored, and B's answer is B's own cold answer."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import transformers
from engine_fixtures import embolden_weights, generate_one, greedy, make_engine, random_prompt, write_word_tokenizer
from l1_fixtures import kvstore_settings, kvstore_stats
from service_processes import free_port, start_kvstore, start_rank_worker

from contracts import internal_auth
from protos import rank_worker_pb2 as pb
from protos import rank_worker_pb2_grpc as pb_grpc
from rank_worker.engine.factory import build_model
from rank_worker.model_files.opener import open_model_source

BLOCK = 16
VOCAB = 96
PROMPT_BLOCKS = 8
MAX_TOKENS = 8


def write_checkpoint(directory: Path, seed: int) -> None:
    """A tiny Llama with bold random weights (greedy argmax far from ties), as save_pretrained writes it."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    embolden_weights(model)
    model.save_pretrained(directory, safe_serialization=True)
    write_word_tokenizer(directory, VOCAB)


def generate(port: int, prompt: list[int]) -> tuple[pb.TokenChunk, pb.Finished, list[int]]:
    """(first token chunk, Finished, every generated token) of one greedy request."""
    sampling = pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    with internal_auth.channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.RankWorkerStub(channel)
        responses = list(stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling), timeout=120))
    chunks = [r.tokens for r in responses if r.HasField("tokens")]
    assert responses[-1].HasField("finished")
    return chunks[0], responses[-1].finished, [token for chunk in chunks for token in chunk.token_ids]


def cold_output(directory: Path, prompt: list[int]) -> list[int]:
    """What the checkpoint in `directory` answers computing the whole prompt itself (in-process, no L1)."""
    model = build_model(open_model_source(str(directory)), torch.device("cpu"), torch.float32, 512, seed=0)
    return generate_one(
        make_engine(model, block_size=BLOCK, max_model_len=512), prompt, greedy(MAX_TOKENS)
    ).new_token_ids


def wait_for_stored_slots(kvstore_port: int, count: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while (stored := kvstore_stats(kvstore_port).stored_slots) < count:
        assert time.monotonic() < deadline, f"L1 holds {stored} blocks, not {count}"
        time.sleep(0.1)


def test_a_checkpoint_swapped_in_place_never_restores_the_old_one_s_l1(tmp_path: Path) -> None:
    model_dir = tmp_path / "models" / "tiny-llama"
    write_checkpoint(model_dir, seed=1)
    prompt = random_prompt(PROMPT_BLOCKS * BLOCK + 5, VOCAB, seed=71)
    kvstore_port, rank_port = free_port(), free_port()
    rank_settings = {
        "KVSERVE_MODEL": str(model_dir),
        "KVSERVE_NUM_KV_BLOCKS": "40",
        "KVSERVE_MAX_MODEL_LEN": "512",
        "KVSERVE_BLOCK_SIZE": str(BLOCK),
        "KVSERVE_KVSTORE": f"127.0.0.1:{kvstore_port}",
        "KVSERVE_RANK_ID": "rank-swap",
    }
    with start_kvstore(tmp_path / "kvstore.log", kvstore_port, **kvstore_settings(tmp_path)):
        with start_rank_worker(tmp_path / "rank-a.log", rank_port, **rank_settings):
            _, finished, a_tokens = generate(rank_port, prompt)
            assert finished.stats.l1_cached_tokens == 0
            wait_for_stored_slots(kvstore_port, PROMPT_BLOCKS)

        with start_rank_worker(tmp_path / "rank-a-again.log", rank_port, **rank_settings):
            first, _, tokens = generate(rank_port, prompt)
            assert first.l1_cached_tokens == PROMPT_BLOCKS * BLOCK  # L0 is empty after a restart: all from L1
            assert tokens == a_tokens

        write_checkpoint(model_dir, seed=2)  # same path and shapes, other weights
        b_cold = cold_output(model_dir, prompt)
        assert b_cold != a_tokens  # otherwise the last check could not tell B's KV from A's
        with start_rank_worker(tmp_path / "rank-b.log", rank_port, **rank_settings):
            first, finished, tokens = generate(rank_port, prompt)
            assert first.l1_cached_tokens == 0 and finished.stats.l1_cached_tokens == 0
            assert tokens == b_cold
