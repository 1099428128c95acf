"""Pack a kit of wheels for the GPU machine into fewer device calls: every wheel rewritten as a stored (uncompressed)
zip, the set tarred and compressed by xz as a whole, split into chunks that each fit one call beside the working
tree. A wheel's deflate leaves its .so files and Python sources compressible; xz over the stored set takes
vLLM's 349 MB kit to about three quarters of that. pip installs a stored wheel as it does a deflated one (its RECORD
hashes the files, not the archive).

    python bench/pack_chunks.py .peer      # .peer/chunkNN (a tar of wheels) -> .peer/chunkNN (xz), in place
    python bench/pack_chunks.py .fa4 --chunk-mib 26

On the GPU machine `bench/unpack_chunks.sh DIR DEST` puts the wheels back (either kind of chunk set)."""

from __future__ import annotations

import argparse
import io
import lzma
import shutil
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.unpack_chunks import read_kit

# the working tree (~22 MB on 2026-12-06, ~31-34 MB on 2026-12-07, with the results' raw files) travels beside each
# chunk within the 64 MiB a call takes; 46 MiB chunks stopped fitting on 2026-12-06, 38 MiB ones on 2026-12-07, and
# 33 MiB ones would not beside the tree of 2026-12-07's second lease
DEFAULT_CHUNK_MIB = 26


def stored(wheel: bytes) -> bytes:
    """The same zip, every member stored: names, order, times and permissions kept."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(wheel)) as source, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
        for info in source.infolist():
            copy = zipfile.ZipInfo(info.filename, info.date_time)
            copy.external_attr = info.external_attr
            copy.create_system = info.create_system
            copy.compress_type = zipfile.ZIP_STORED
            target.writestr(copy, source.read(info))
    return out.getvalue()


def pack(wheels: list[tuple[str, bytes]], folder: Path, chunk_bytes: int) -> list[Path]:
    """Write the wheels (stored) as one xz-compressed tar split into folder/chunkNN; returns the chunks."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, wheel in sorted(wheels):
            body = stored(wheel) if name.endswith(".whl") else wheel
            info = tarfile.TarInfo(f"./{name}")
            info.size, info.mode = len(body), 0o644
            tar.addfile(info, io.BytesIO(body))
    packed = lzma.compress(raw.getvalue(), preset=9)
    with tempfile.TemporaryDirectory(dir=folder.parent) as staging:
        chunks = []
        for index, start in enumerate(range(0, len(packed), chunk_bytes)):
            chunk = Path(staging) / f"chunk{index:02d}"
            chunk.write_bytes(packed[start : start + chunk_bytes])
            chunks.append(chunk)
        for old in folder.glob("chunk*"):
            old.unlink()
        return [Path(shutil.move(chunk, folder / chunk.name)) for chunk in chunks]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="a chunk set: .peer or .fa4")
    parser.add_argument("--chunk-mib", type=float, default=DEFAULT_CHUNK_MIB)
    args = parser.parse_args(argv)
    try:
        wheels = read_kit(args.folder)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    before = sum(len(wheel) for _, wheel in wheels)
    chunks = pack(wheels, args.folder, int(args.chunk_mib * (1 << 20)))
    after = sum(chunk.stat().st_size for chunk in chunks)
    print(f"{len(wheels)} files, {before / 1e6:.0f} MB as wheels -> {after / 1e6:.0f} MB in {len(chunks)} chunks")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
