"""Shared pieces of the reliability tests: caches with a recognisable content,
and a check that a stored entry is whole and is one of the versions sent."""

from __future__ import annotations

import json
import os
import resource
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

import kvkeeper

FP = "fault-model"
MiB = 2**20
_TOKEN_BYTES_PER_LAYER = 8 * 128 * 2 * 2  # 8 kv heads x dim 128 x bf16 x (keys, values)


def filled(mib: float, version: int, layers: int = 4) -> list[KVCache]:
    """A cache of about ``mib`` MiB whose every element is ``version % 256``
    (exact in bf16), so a loaded file tells which version it holds."""
    tokens = max(1, int(mib * MiB / (_TOKEN_BYTES_PER_LAYER * layers)))
    out = []
    for _ in range(layers):
        c = KVCache()
        x = mx.full((1, 8, tokens, 128), float(version % 256), dtype=mx.bfloat16)
        c.update_and_fetch(x, x)
        out.append(c)
    return out


def version_of(path: Path, model: str = FP) -> int:
    """Open an entry with checksums verified; return the version it holds,
    after checking every element agrees with its token ids."""
    got = kvkeeper.read_cache_file(path, model=model)
    assert got.token_ids is not None and len(got.token_ids) == 1
    v = got.token_ids[0]
    for layer in got.cache:
        k, val = layer.state[:2]
        assert mx.all(k == v % 256).item() and mx.all(val == v % 256).item(), path
    return v



def version_now(path: Path, model: str = FP) -> int | None:
    """``version_of``, or None when a newer version replaced the file while
    it was read (a wait for a save being written polls it meanwhile)."""
    try:
        return version_of(path, model)
    except kvkeeper.CacheFileError as exc:
        if exc.replaced:
            return None
        raise


def resealed(header: dict) -> dict:
    """``header`` (decoded JSON) with its header checksum made right again:
    a file a writer got wrong on purpose, not one damaged on the disk."""
    from kvkeeper.protocol import safetensors as st

    meta = header["__metadata__"]
    sums = json.loads(meta[st.CHECKSUMS_KEY])
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    sums["header"] = st.header_digest(meta, tensors)
    meta[st.CHECKSUMS_KEY] = json.dumps(sums)
    return header


def rewrite_header(path: Path, change: Callable[[dict], object]) -> None:
    """Rewrite a safetensors file's header in place: ``change`` edits the
    decoded header; the tensor bytes stay as they are."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    change(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


def entry_path(root: Path, cache_id: str, model: str = FP) -> Path:
    from kvkeeper.protocol import naming

    return naming.entry_path(root, model, cache_id)


def tmp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith(".tmp")]


def need_linux_root() -> None:
    """Mounts, libfiu and other users' credentials need Linux and root (CI has both)."""
    if sys.platform != "linux":
        pytest.skip("mounts, libfiu and peer credentials are Linux-only tools")
    assert os.geteuid() == 0, "these fault tests need root (CI runs as root)"


#: Runs a command as root without the right to pass file permissions: as
#: an ordinary user meets a directory or file it may not write.
NO_DAC = ("setpriv", "--bounding-set=-dac_override,-dac_read_search",
          "--inh-caps=-dac_override,-dac_read_search")


def limit_file_size(nbytes: int):  # type: ignore[no-untyped-def]
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))

    return apply


def run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=60)


@contextmanager
def small_disk(parent: Path, mib: int, kind: str = "ext4") -> Iterator[Path]:
    """An ext4 image of ``mib`` MiB, no blocks reserved for root, loop-mounted
    at ``parent/ext4``: a small real disk (a tmpfs takes a new directory
    with no free block; ext4 needs one). ``kind`` "xfs" (at least 300 MiB)
    or "btrfs" makes one of those instead: both free an unlinked file's
    blocks later (in the background; at the transaction's commit)."""
    need_linux_root()
    img, mnt = parent / f"{kind}.img", parent / kind
    with open(img, "wb") as f:
        f.truncate(mib * 2**20)
    run(*{"ext4": ("mkfs.ext4", "-q", "-F", "-m", "0"), "xfs": ("mkfs.xfs", "-q", "-f"),
          "btrfs": ("mkfs.btrfs", "-q", "-f")}[kind], str(img))
    mnt.mkdir(mode=0o700)
    run("mount", "-o", "loop", str(img), str(mnt))
    try:
        yield mnt
    finally:
        run("umount", "-l", str(mnt))
        img.unlink()
        mnt.rmdir()


@contextmanager
def small_tmpfs(parent: Path, size: str, inodes: int | None = None,
                name: str = "small") -> Iterator[Path]:
    """A tmpfs of ``size`` (e.g. "6m"; and of ``inodes`` inodes) mounted at
    ``parent/name``: a small disk. ``size`` "ramfs" mounts a ramfs, which
    has no size at all."""
    need_linux_root()
    mnt = parent / name
    mnt.mkdir(mode=0o700)
    if size == "ramfs":
        run("mount", "-t", "ramfs", "-o", "mode=0700", "ramfs", str(mnt))
    else:
        more = "" if inodes is None else f",nr_inodes={inodes}"
        run("mount", "-t", "tmpfs", "-o", f"size={size},mode=0700{more}", "tmpfs", str(mnt))
    try:
        yield mnt
    finally:
        run("umount", "-l", str(mnt))
