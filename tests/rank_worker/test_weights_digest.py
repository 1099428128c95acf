"""The weights digest in the block-hash namespace: another checkpoint under the same directory name and
tokenizer (one changed weight byte, another config, random weights of another seed) gets another namespace;
the same files, reloaded or copied elsewhere, keep theirs."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from engine_fixtures import write_word_tokenizer
from test_model_files import skeleton, write_gguf

from contracts.config import KvServeConfig
from rank_worker.engine.factory import build_engine
from rank_worker.model_files import weights_digest
from rank_worker.model_files.opener import open_model_source
from rank_worker.model_files.weights_digest import safetensors_layout

VOCAB = 96
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)


def write_checkpoint(directory: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, max_position_embeddings=256))
    model.save_pretrained(directory, safe_serialization=True)
    write_word_tokenizer(directory, VOCAB)
    return directory


def namespace(model: Path | str, **settings: object) -> bytes:
    """The namespace a rank serving `model` announces (ModelInfo, which the gateway hashes prompts with)."""
    config = KvServeConfig(model=str(model), device="cpu", num_kv_blocks=4, **settings)  # type: ignore[arg-type]
    return build_engine(config).model_info.hash_namespace


def flip_byte(path: Path, offset: int) -> None:
    with path.open("r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0x01]))


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    return write_checkpoint(tmp_path / "a" / "tiny-llama")


def test_same_files_keep_their_namespace_across_reloads_and_copies(checkpoint: Path, tmp_path: Path) -> None:
    first = open_model_source(str(checkpoint)).weights_digest
    assert open_model_source(str(checkpoint)).weights_digest == first
    copy = tmp_path / "elsewhere" / "tiny-llama"
    shutil.copytree(checkpoint, copy)  # new inode and mtimes, same bytes
    os.utime(copy / "model.safetensors", (1, 1))
    assert open_model_source(str(copy)).weights_digest == first
    assert namespace(copy) == namespace(checkpoint)


def test_one_changed_weight_byte_changes_the_namespace(checkpoint: Path) -> None:
    before = namespace(checkpoint)
    shard = checkpoint / "model.safetensors"
    header_end, _ = safetensors_layout(shard)
    stat = shard.stat()
    flip_byte(shard, header_end + (stat.st_size - header_end) // 2)
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size and mtime: only the data differs
    assert namespace(checkpoint) != before


def test_a_fine_tune_in_place_changes_the_namespace(checkpoint: Path) -> None:
    """Same shapes, names and config, every weight different: the whole checkpoint rewritten in place."""
    before = namespace(checkpoint)
    write_checkpoint(checkpoint, seed=1)
    assert namespace(checkpoint) != before


def test_a_changed_config_changes_the_namespace(checkpoint: Path) -> None:
    before = namespace(checkpoint)
    config_path = checkpoint / "config.json"
    config = json.loads(config_path.read_text())
    config["rms_norm_eps"] = 1e-5
    config_path.write_text(json.dumps(config))
    assert namespace(checkpoint) != before


def test_random_weights_of_another_seed_get_another_namespace(checkpoint: Path) -> None:
    config_json = checkpoint / "config.json"
    seed0 = namespace(config_json, load_format="dummy", seed=0)
    assert namespace(config_json, load_format="dummy", seed=0) == seed0
    assert namespace(config_json, load_format="dummy", seed=1) != seed0
    assert namespace(checkpoint) != seed0  # the real weights of that config are not its random ones
    assert namespace(config_json, load_format="dummy", seed=0, random_weights="uniform") != seed0  # vLLM's draw


def test_large_files_are_sampled_in_every_tensor(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past WHOLE_FILE_BYTES only the header and each tensor's first, middle and last bytes are read; a change
    at either end of any tensor, or in the header, still shows."""
    monkeypatch.setattr(weights_digest, "WHOLE_FILE_BYTES", 0)
    monkeypatch.setattr(weights_digest, "SAMPLE_BYTES", 64)
    shard = checkpoint / "model.safetensors"
    header_end, spans = safetensors_layout(shard)
    assert len(spans) == 3 + 9 * SHAPE["num_hidden_layers"]  # embeddings, final norm, lm_head, 9 per layer
    seen = {open_model_source(str(checkpoint)).weights_digest}
    for begin, end in spans:
        for offset in (begin, end - 1):
            flip_byte(shard, offset)
            seen.add(open_model_source(str(checkpoint)).weights_digest)
    flip_byte(shard, shard.read_bytes()[:header_end].index(b'"pt"') + 1)  # header metadata: "format": "qt"
    seen.add(open_model_source(str(checkpoint)).weights_digest)
    assert len(seen) == 2 * len(spans) + 2


def test_gguf_digest_covers_metadata_and_tensor_data(tmp_path: Path) -> None:
    tensors = skeleton(VOCAB)
    path = write_gguf(tmp_path / "m.gguf", "llama", tensors)
    base = open_model_source(str(path)).weights_digest
    assert open_model_source(str(path)).weights_digest == base
    tensors["blk.1.ffn_down.weight"][3, 5] = 0.5
    assert open_model_source(str(write_gguf(path, "llama", tensors))).weights_digest != base
    tensors["blk.1.ffn_down.weight"][3, 5] = 0.0
    assert open_model_source(str(write_gguf(path, "llama", tensors))).weights_digest == base
    assert open_model_source(str(write_gguf(path, "llama", tensors, rope_theta=5e5))).weights_digest != base
