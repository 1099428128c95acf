"""On the GPU machine: the wheels of a chunk set (FOLDER/chunkNN in order: a tar, or an xz-compressed tar from
bench/pack_chunks.py) into DEST. The standard library only: it runs before anything is installed.

    python3 bench/unpack_chunks.py /tmp/acc /tmp/vw"""

from __future__ import annotations

import io
import lzma
import sys
import tarfile
import zipfile
from pathlib import Path

XZ_MAGIC = b"\xfd7zXZ\x00"


def read_kit(folder: Path) -> list[tuple[str, bytes]]:
    """The files of a chunk set, by name (flat: a kit is a folder of wheels). Raises ValueError for a set with a
    part missing or cut short (xz's check, the tar's end or a wheel's CRCs find it)."""
    parts = sorted(folder.glob("chunk*"))
    if not parts:
        raise ValueError(f"no {folder}/chunk*")
    data = b"".join(part.read_bytes() for part in parts)
    try:
        if data.startswith(XZ_MAGIC):
            data = lzma.decompress(data)
        files = []
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            for member in tar.getmembers():
                handle = tar.extractfile(member) if member.isfile() else None
                if handle is not None:
                    files.append((Path(member.name).name, handle.read()))
        for name, body in files:  # a plain tar cut in the middle can still read: its wheels' CRCs cannot
            if name.endswith(".whl"):
                _check_wheel(name, body)
    except (lzma.LZMAError, EOFError, tarfile.TarError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{folder}'s {len(parts)} chunks are not a whole kit ({exc}): send them again") from exc
    return files


def _check_wheel(name: str, body: bytes) -> None:
    """Raises zipfile.BadZipFile where the wheel is not a whole zip with every member's CRC right."""
    try:
        bad = zipfile.ZipFile(io.BytesIO(body)).testzip()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:  # a cut zip's directory points past it
        raise zipfile.BadZipFile(f"{name}: {exc}") from exc
    if bad is not None:
        raise zipfile.BadZipFile(f"{name}: {bad} is corrupt")


def unpack(folder: Path, dest: Path) -> list[str]:
    """Extract every file of the set into dest; returns their names."""
    files = read_kit(folder)
    dest.mkdir(parents=True, exist_ok=True)
    for name, body in files:
        (dest / name).write_bytes(body)
    return [name for name, _ in files]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        names = unpack(Path(argv[0]), Path(argv[1]))
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"{len(names)} files into {argv[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
