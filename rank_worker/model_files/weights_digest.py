"""A digest of what defines a checkpoint's weights, for the KV-cache namespace.

Two checkpoints that share a directory name and a tokenizer (a fine-tune, a model replaced in place, a new
snapshot, random weights of another seed) must never share KV blocks: the L1 arena outlives rank restarts,
so a shared key restores the old model's KV and outputs go silently wrong.

What goes in: config.json, the safetensors index, the hub revision, and for each weight file its size, its
header (safetensors JSON header / GGUF metadata and tensor infos: names, dtypes, shapes, offsets) and
sampled bytes of every tensor. Headers alone do not change for a fine-tune of the same shapes, and hashing
every byte would cost a second per GB at each start; file size and mtime are not the data (a copy changes
the mtime, a rewrite in place can keep size and mtime). So each tensor's first, middle and last 4 KiB are
hashed: a fine-tune or a merged adapter changes every entry of the matrices it touches, so any tensor it
changes changes there. Files up to WHOLE_FILE_BYTES are hashed whole (a tiny test checkpoint detects one
changed byte anywhere). What it cannot see: an edit confined to the unsampled middle of a large tensor.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import xxhash

from rank_worker.model_files.source import ModelPathError

WHOLE_FILE_BYTES = 16 << 20
SAMPLE_BYTES = 4096
_READ_CHUNK = 4 << 20

# (begin, end) byte offsets of one tensor's data in its file.
Span = tuple[int, int]


def hf_weights_digest(directory: Path, config_path: Path, index_path: Path | None, shards: Sequence[Path]) -> str:
    """Digest of a Hugging Face directory's weights: config, index, revision, and each shard sampled."""
    digest = xxhash.xxh3_128()
    _add(digest, b"hf")
    _add(digest, config_path.read_bytes())
    _add(digest, index_path.read_bytes() if index_path is not None else b"")
    _add(digest, _hub_revision(directory).encode())
    for shard in shards:
        _add(digest, shard.name.encode())
        header_end, spans = safetensors_layout(shard)
        _add_sampled_file(digest, shard, header_end, spans)
    return digest.hexdigest()


def gguf_weights_digest(path: Path, data_offset: int, spans: Sequence[Span]) -> str:
    """Digest of a GGUF file: everything before the tensor data (metadata and tensor infos), then each
    tensor sampled."""
    digest = xxhash.xxh3_128()
    _add(digest, b"gguf")
    _add_sampled_file(digest, path, data_offset, spans)
    return digest.hexdigest()


def config_digest(config_path: Path) -> str:
    """Digest of a config.json alone: what random weights are shaped by (the seed is added by
    random_weights_digest once the engine knows it)."""
    digest = xxhash.xxh3_128()
    _add(digest, b"config")
    _add(digest, config_path.read_bytes())
    return digest.hexdigest()


def random_weights_digest(config_digest_hex: str, seed: int, device_type: str, init_scheme: str) -> str:
    """Digest of random weights: their shape (config), seed, the device whose generator drew them (torch's
    CPU and CUDA generators give different numbers for one seed) and the init scheme that drew them."""
    digest = xxhash.xxh3_128()
    for part in ("random", config_digest_hex, str(seed), device_type, init_scheme):
        _add(digest, part.encode())
    return digest.hexdigest()


def safetensors_layout(path: Path) -> tuple[int, list[Span]]:
    """(end of the header, each tensor's absolute byte span) of a safetensors file, from its JSON header."""
    try:
        with path.open("rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            if header_len > path.stat().st_size - 8:
                raise ValueError(f"header length {header_len} exceeds the file")
            header = json.loads(handle.read(header_len))
    except (OSError, ValueError, struct.error) as exc:
        raise ModelPathError(f"cannot read safetensors header of {path}: {exc}") from exc
    data_start = 8 + header_len
    spans = [
        (data_start + int(entry["data_offsets"][0]), data_start + int(entry["data_offsets"][1]))
        for name, entry in header.items()
        if name != "__metadata__"
    ]
    return data_start, sorted(spans)


def _hub_revision(directory: Path) -> str:
    """The commit a Hugging Face hub cache snapshot was taken at (the snapshot folder's name), else ""."""
    directory = directory.resolve()
    return directory.name if directory.parent.name == "snapshots" else ""


def _add(digest: xxhash.xxh3_128, data: bytes) -> None:
    # Length-prefixed, so the boundaries between parts are part of what is hashed.
    digest.update(struct.pack("<Q", len(data)))
    digest.update(data)


def _add_sampled_file(digest: xxhash.xxh3_128, path: Path, header_end: int, spans: Sequence[Span]) -> None:
    try:
        _add_sampled_bytes(digest, path, header_end, spans)
    except (OSError, EOFError) as exc:
        raise ModelPathError(f"cannot read {path} to fingerprint its weights: {exc}") from exc


def _add_sampled_bytes(digest: xxhash.xxh3_128, path: Path, header_end: int, spans: Sequence[Span]) -> None:
    size = path.stat().st_size
    digest.update(struct.pack("<Q", size))
    fd = os.open(path, os.O_RDONLY)
    try:
        if size <= WHOLE_FILE_BYTES:
            _add_range(digest, fd, 0, size)
            return
        _add_range(digest, fd, 0, header_end)
        for begin, end in spans:
            if end - begin <= 3 * SAMPLE_BYTES:
                _add_range(digest, fd, begin, end)
                continue
            middle = begin + (end - begin) // 2 - SAMPLE_BYTES // 2
            for start in (begin, middle, end - SAMPLE_BYTES):
                _add_range(digest, fd, start, start + SAMPLE_BYTES)
    finally:
        os.close(fd)


def _add_range(digest: xxhash.xxh3_128, fd: int, begin: int, end: int) -> None:
    position = begin
    while position < end:
        chunk = os.pread(fd, min(_READ_CHUNK, end - position), position)
        if not chunk:
            raise EOFError(f"the file ends at byte {position}, before {end} (truncated?)")
        digest.update(chunk)
        position += len(chunk)
