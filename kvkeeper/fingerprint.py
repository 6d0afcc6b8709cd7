"""A stable fingerprint of a local model directory.

A saved prompt cache is only valid for the exact model that built it, so each
cache records its model's fingerprint and a mismatch is refused on load. The
fingerprint has to be cheap (it is computed at start-up, for models of many
GiB) and independent of where the directory lives, so it covers:

* ``config.json`` and the tokenizer files: their full content (small files);
* weight files: relative name and size, and for ``*.safetensors`` the header
  (8-byte length plus the JSON header: names, dtypes, shapes, offsets,
  metadata) and the first and last 64 bytes of every tensor; other weight
  files, 16 blocks of 4 KiB spread over the file. A fine-tune, a fused LoRA
  or another revision keeps the layout and changes the values (of every
  tensor it trains, densely), so the layout alone gave both models one
  fingerprint; a few bytes of each tensor tell them apart without reading
  the weights (a 70B model's few thousand tensors: a few thousand small
  reads).

Hidden files and directories (``.git``, ``.cache``) and anything else
(READMEs, images) are ignored.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from kvkeeper.walk import walk

__all__ = ["model_fingerprint"]

#: Bump when the set of inputs or their encoding changes.
_FP_VERSION = "kvkeeper-model-fp-2"  # 2: samples of the weight values

_TOKENIZER_FILES = frozenset(
    {
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.model",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "chat_template.json",
        "chat_template.jinja",
    }
)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".npz", ".npy", ".pt", ".pth")
_CONTENT_SUFFIXES = (".safetensors.index.json",)

# A safetensors header is JSON describing tensors; anything near this size is
# not a header but a corrupt length field.
_MAX_HEADER = 100 * 1024 * 1024


def _files(root: Path) -> Iterator[tuple[str, Path]]:
    """(relative posix path, path) of every non-hidden file under root, sorted."""
    found = []
    seen: set[tuple[int, int]] = set()
    # Follow symlinks (Hugging Face snapshots are made of them) but never loop.
    for dirpath, dirnames, filenames in walk(root, followlinks=True):
        st = os.stat(dirpath)
        if (st.st_dev, st.st_ino) in seen:
            dirnames[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        # Sorted: which of two links to one directory is walked (the other is
        # then skipped as seen) must not depend on the listing's order, which
        # differs between two copies of a model (a review's find).
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            if not name.startswith("."):
                path = Path(dirpath, name)
                found.append((path.relative_to(root).as_posix(), path))
    return iter(sorted(found))


def _content_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


#: Bytes read from each end of a tensor's data.
_SAMPLE = 64
#: Other weight files: this many blocks of _BLOCK bytes, spread evenly.
_BLOCKS, _BLOCK = 16, 4096


def _safetensors_digest(path: Path, size: int) -> str:
    """sha256 of the length prefix, the JSON header, and the first and last
    ``_SAMPLE`` bytes of each tensor's data, in the order of the data (a
    body cut short gives what is there)."""
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path}: too short for a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", prefix)
        if n > _MAX_HEADER or 8 + n > size:
            raise ValueError(f"{path}: bad safetensors header length {n} (file is {size} bytes)")
        header = f.read(n)
        if len(header) != n:
            raise ValueError(f"{path}: safetensors header is truncated")
        h = hashlib.sha256(prefix + header)
        spans = _tensor_spans(header)
        _no_readahead(f)
        if spans is None:  # not a table MLX would load either: sample it as any file
            h.update(_blocks_digest(f, size).encode())
        for begin, end in spans or ():
            # Offsets past the end (a body cut short, or a damaged header:
            # 2**63 overflowed pread) read what is there: nothing.
            for at, length in _samples(min(8 + n + begin, size), min(8 + n + end, size)):
                h.update(os.pread(f.fileno(), length, at))
    return h.hexdigest()


def _no_readahead(f: BinaryIO) -> None:
    """Ask the kernel not to read ahead of the samples: a few thousand
    64-byte reads pulled some 20 KiB each into the page cache (a review
    measured 390 MiB for 20,000 tensors). Where there is no such advice
    (macOS), the reads go as they are."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is not None:
        try:
            advise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        except OSError:
            pass  # advice only


def _tensor_spans(header: bytes) -> list[tuple[int, int]] | None:
    """The data offsets of each tensor a safetensors header lists, in order;
    None for a header that is not such a table."""
    try:
        table = json.loads(header)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(table, dict):
        return None
    spans = []
    for name, info in table.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(type(x) is int for x in offsets) and 0 <= offsets[0] <= offsets[1]):
            return None
        spans.append((offsets[0], offsets[1]))
    return sorted(spans)


def _samples(begin: int, end: int) -> list[tuple[int, int]]:
    """(offset, length) of the first and last ``_SAMPLE`` bytes of a span
    (the whole span when it is short)."""
    if end - begin <= 2 * _SAMPLE:
        return [(begin, end - begin)]
    return [(begin, _SAMPLE), (end - _SAMPLE, _SAMPLE)]


def _blocks_digest(f: BinaryIO, size: int) -> str:
    """sha256 of ``_BLOCKS`` blocks spread evenly over a file of ``size`` bytes."""
    h = hashlib.sha256()
    last = max(0, size - _BLOCK)
    for i in range(_BLOCKS):
        h.update(os.pread(f.fileno(), _BLOCK, last * i // (_BLOCKS - 1)))
    return h.hexdigest()


def _weights_digest(path: Path, size: int) -> str:
    if path.name.endswith(".safetensors"):
        return _safetensors_digest(path, size)
    with path.open("rb") as f:
        _no_readahead(f)
        return _blocks_digest(f, size)


#: What mlx-lm's load reads of an adapter directory (mlx_lm.utils.load_adapters).
_ADAPTER_CONFIG, _ADAPTER_WEIGHTS = "adapter_config.json", "adapters.safetensors"


def _adapter_entries(root: Path) -> list[list[object]]:
    """The fingerprint's entries of an unfused adapter directory (see
    ``model_fingerprint``); ValueError when it is not one."""
    config, weights = root / _ADAPTER_CONFIG, root / _ADAPTER_WEIGHTS
    if not root.is_dir() or not config.is_file() or not weights.is_file():
        raise ValueError(f"{str(root)!r} is not a LoRA adapter directory: it needs "
                         f"{_ADAPTER_CONFIG} and {_ADAPTER_WEIGHTS}")
    try:
        size = weights.stat().st_size
        return [["adapter-content", _ADAPTER_CONFIG, _content_digest(config)],
                ["adapter-weights", _ADAPTER_WEIGHTS, size, _weights_digest(weights, size)]]
    except OSError as exc:
        raise ValueError(f"{str(root)!r}: cannot read the adapter: "
                         f"{exc.strerror or exc}") from None


def _model_file_entries(root: Path) -> list[list[object]]:
    """The entry of the model's own code, where config.json names one
    (``model_file``: mlx-lm and mlx-vlm build the model from that Python
    file, given trust_remote_code): another version of it computes other
    keys and values from the same weights. Not every .py file: many
    downloads carry code neither library runs, and those models'
    fingerprints would change with this version for nothing."""
    try:
        config = json.loads((root / "config.json").read_bytes())
    except (OSError, ValueError):
        return []  # (read above already: then neither library loads it)
    model_file = config.get("model_file") if isinstance(config, dict) else None
    if not isinstance(model_file, str) or not model_file:
        return []
    code = root / model_file
    try:
        if not stat.S_ISREG(code.stat().st_mode):
            return [["code", model_file, "not a file"]]  # (a FIFO would hang the read)
        return [["code", model_file, _content_digest(code)]]
    except FileNotFoundError:
        return [["code", model_file, "missing"]]  # neither library loads it either
    except OSError as exc:
        raise ValueError(f"{str(root)!r}: cannot read the model_file {model_file!r} "
                         f"config.json names: {exc.strerror or exc}") from None


def model_fingerprint(path: str | os.PathLike[str], *,
                      adapter_path: str | os.PathLike[str] | None = None) -> str:
    """Fingerprint the model in directory `path`: ``"m-"`` followed by 32 hex digits.

    ``adapter_path``: the LoRA adapter directory the model is loaded with
    unfused (``mlx_lm.load(path, adapter_path=...)``): its
    ``adapter_config.json`` by content and ``adapters.safetensors`` as a
    weight file count too. The base model's fingerprint alone would hand
    the base model's caches to the adapted model, and each adapter's to the
    others. ValueError when it is not such a directory.

    Deterministic and independent of the directory's location and of file
    times: it changes when config.json, a tokenizer file, the set or size of
    the weight files, a safetensors header, or the values at either end of
    a tensor (or in one of the blocks sampled from another weight file)
    change, as does the Python file config.json names as ``model_file``
    (custom model code). Weight data is read only there (a weight file this user may not
    read counts by name and size, or by name alone when even its size is
    hidden; files that are not regular files are left out). Raises
    FileNotFoundError when `path` does not exist and ValueError when it is
    not a directory, has no config.json, holds a safetensors file with a
    broken header, or a file it reads is a broken symlink (a Hugging Face
    download left unfinished), a symlink loop, a config or tokenizer file
    this user may not read, or fails to read."""
    if not os.fspath(path):
        # Path("") is the working directory: surely an unset variable.
        raise ValueError("model path is empty: give the model's directory")
    root = Path(path)
    if not root.exists():
        hint = ("; for a Hugging Face model name, give its local snapshot directory "
                "(huggingface_hub.snapshot_download(name, local_files_only=True))"
                if not root.is_absolute() and len(root.parts) == 2 else "")
        raise FileNotFoundError(f"model directory {str(root)!r} does not exist{hint}")
    if not root.is_dir():
        raise ValueError(f"model path {str(root)!r} is not a directory")
    if not (root / "config.json").is_file():
        raise ValueError(f"{str(root)!r} is not a model directory: it has no config.json")

    entries: list[list[object]] = []
    for rel, file in _files(root):
        name = file.name
        content = rel == "config.json" or name in _TOKENIZER_FILES \
            or name.endswith(_CONTENT_SUFFIXES)
        if not content and not name.endswith(_WEIGHT_SUFFIXES):
            continue
        try:
            st = file.stat()
            if not stat.S_ISREG(st.st_mode):
                continue  # a FIFO would hang the read, a link to /dev/zero never end
            if content:
                entries.append(["content", rel, _content_digest(file)])
                continue
            try:
                digest = _weights_digest(file, st.st_size)
            except PermissionError:
                # Another user's file (a root-owned training_args.bin): by
                # name and size (this model cannot load it either).
                digest = "unreadable"
            entries.append(["weights", rel, st.st_size, digest])
        except FileNotFoundError:
            # A FileNotFoundError would say the directory is missing.
            raise ValueError(f"{str(root)!r}: {rel} is a broken symlink (an unfinished "
                             f"download?) or was removed meanwhile") from None
        except PermissionError:
            if content:
                raise ValueError(f"{str(root)!r}: cannot read {rel} (permission denied)") from None
            # A link into a directory this user may not enter: by name.
            entries.append(["weights", rel, "unreadable"])
        except OSError as exc:  # a symlink loop (ELOOP), an I/O error
            raise ValueError(f"{str(root)!r}: cannot read {rel}: {exc.strerror or exc}") from None
    entries += _model_file_entries(root)
    if adapter_path is not None:
        entries += _adapter_entries(Path(adapter_path))
    h = hashlib.sha256(_FP_VERSION.encode())
    for entry in entries:
        h.update(b"\n" + json.dumps(entry, separators=(",", ":")).encode())
    return "m-" + h.hexdigest()[:32]
