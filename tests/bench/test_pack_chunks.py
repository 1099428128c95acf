"""bench/pack_chunks.py and bench/unpack_chunks.py: a kit of wheels (a tar split into chunks) packed as stored wheels
in one xz stream comes back as wheels with the same members, pip installs them to the same files as the originals,
a plain tar set still unpacks, and a set with a part missing is refused by name."""

from __future__ import annotations

import base64
import hashlib
import io
import random
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from bench.pack_chunks import main as pack_main
from bench.unpack_chunks import unpack


def _wheel(name: str, payload: bytes) -> bytes:
    """A valid, deflated wheel of one module holding payload (a docstring pip leaves alone)."""
    dist = f"{name}-1.0.dist-info"
    files = {
        f"{name}.py": b'"""' + payload + b'"""\n',
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, body in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(body).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(body)}")
    files[f"{dist}/RECORD"] = ("\n".join([*record, f"{dist}/RECORD,,"]) + "\n").encode()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as wheel:
        for path, body in files.items():
            wheel.writestr(path, body)
    return out.getvalue()


def _kit(folder: Path, wheels: dict[str, bytes], chunk_bytes: int) -> None:
    """A kit as the builders write it: a plain tar of wheels split into chunkNN."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, body in wheels.items():
            info = tarfile.TarInfo(f"./{name}")
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    data = raw.getvalue()
    folder.mkdir()
    for index, start in enumerate(range(0, len(data), chunk_bytes)):
        (folder / f"chunk{index:02d}").write_bytes(data[start : start + chunk_bytes])


def _members(wheel: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(wheel) as archive:
        return {info.filename: archive.read(info) for info in archive.infolist()}


def _installed(wheels: list[Path], target: Path) -> dict[str, bytes]:
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(target), *wheels],
        check=True,
    )
    return {str(p.relative_to(target)): p.read_bytes() for p in sorted(target.rglob("*.py"))}


def test_packed_wheels_unpack_and_install_as_the_originals(tmp_path: Path) -> None:
    text = b"compressible text " * 20_000  # a deflated wheel leaves this to xz over the whole set
    originals = {"alpha-1.0-py3-none-any.whl": _wheel("alpha", text), "beta-1.0-py3-none-any.whl": _wheel("beta", text)}
    kit = tmp_path / "kit"
    _kit(kit, originals, chunk_bytes=4096)
    before = sum(p.stat().st_size for p in kit.glob("chunk*"))
    assert pack_main([str(kit), "--chunk-mib", str(256 / (1 << 20))]) == 0
    chunks = sorted(kit.glob("chunk*"))
    assert len(chunks) >= 2 and sum(p.stat().st_size for p in chunks) < before  # split, and smaller
    assert chunks[0].read_bytes().startswith(b"\xfd7zXZ\x00")

    names = unpack(kit, tmp_path / "out")
    assert sorted(names) == sorted(originals)
    for name, body in originals.items():
        (tmp_path / "orig").mkdir(exist_ok=True)
        (tmp_path / "orig" / name).write_bytes(body)
        again = tmp_path / "out" / name
        assert _members(again) == _members(tmp_path / "orig" / name)
        with zipfile.ZipFile(again) as archive:
            assert {info.compress_type for info in archive.infolist()} == {zipfile.ZIP_STORED}
    packed = _installed(sorted((tmp_path / "out").glob("*.whl")), tmp_path / "site-packed")
    plain = _installed(sorted((tmp_path / "orig").glob("*.whl")), tmp_path / "site-plain")
    assert packed == plain and set(packed) == {"alpha.py", "beta.py"}

    # packing a packed set again gives the same wheels
    assert pack_main([str(kit)]) == 0
    assert sorted(unpack(kit, tmp_path / "twice")) == sorted(originals)


def test_a_plain_set_unpacks_and_a_set_with_a_part_missing_is_refused(tmp_path: Path) -> None:
    kit = tmp_path / "kit"
    noise = random.Random(0).randbytes(50_000)  # deflate keeps it as long: the tar's data spans the chunks
    _kit(kit, {"gamma-1.0-py3-none-any.whl": _wheel("gamma", noise)}, chunk_bytes=8192)
    assert unpack(kit, tmp_path / "plain") == ["gamma-1.0-py3-none-any.whl"]
    (kit / "chunk01").unlink()
    left = sorted(kit.glob("chunk*"))
    with pytest.raises(ValueError, match="not a whole kit"):
        unpack(kit, tmp_path / "broken")
    with pytest.raises(SystemExit, match="not a whole kit"):  # the packer refuses it too, and leaves it as it was
        pack_main([str(kit)])
    assert sorted(kit.glob("chunk*")) == left  # nothing written
