"""kvkeeper.fingerprint: a model directory's identity, from config, tokenizer and weight headers."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import pytest

from kvkeeper.fingerprint import model_fingerprint


def safetensors_bytes(shape: list[int], body: bytes | None = None) -> bytes:
    """A valid safetensors file with one F32 tensor (body zero-filled unless given)."""
    n = 4
    for d in shape:
        n *= d
    header = json.dumps(
        {
            "w": {"dtype": "F32", "shape": shape, "data_offsets": [0, n]},
            "__metadata__": {"format": "mlx"},
        }
    ).encode()
    return struct.pack("<Q", len(header)) + header + (body if body is not None else bytes(n))


@pytest.fixture
def model(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    (d / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}}}))
    (d / "tokenizer_config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(safetensors_bytes([4, 8]))
    (d / "README.md").write_text("a model")
    return d


def test_format_and_determinism(model: Path, tmp_path: Path) -> None:
    fp = model_fingerprint(model)
    assert re.fullmatch(r"m-[0-9a-f]{32}", fp)
    assert model_fingerprint(str(model)) == fp
    # Independent of the directory's location and of file times.
    copy = tmp_path / "elsewhere" / "copy"
    shutil.copytree(model, copy)
    os.utime(copy / "config.json", (1, 1))
    assert model_fingerprint(copy) == fp


def test_config_and_tokenizer_changes_change_it(model: Path) -> None:
    fp = model_fingerprint(model)
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 9}))
    fp_config = model_fingerprint(model)
    assert fp_config != fp
    (model / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 1, "b": 0}}}))
    assert model_fingerprint(model) not in (fp, fp_config)


def test_weight_header_name_and_size_change_it(model: Path) -> None:
    fp = model_fingerprint(model)
    weights = model / "model.safetensors"
    weights.write_bytes(safetensors_bytes([8, 4]))  # same size, different header
    fp_header = model_fingerprint(model)
    assert fp_header != fp
    weights.rename(model / "model-00001-of-00001.safetensors")
    fp_name = model_fingerprint(model)
    assert fp_name not in (fp, fp_header)
    (model / "extra.bin").write_bytes(b"\0" * 10)
    assert model_fingerprint(model) != fp_name


def test_weight_values_change_it_and_other_files_do_not(model: Path) -> None:
    fp = model_fingerprint(model)
    (model / "README.md").write_text("edited")
    (model / ".cache").mkdir()
    (model / ".cache" / "tokenizer.json").write_text("hidden")
    assert model_fingerprint(model) == fp
    # The same layout with other values (a fine-tune): the layout alone gave
    # both one fingerprint, and each took the other's caches.
    (model / "model.safetensors").write_bytes(safetensors_bytes([4, 8], body=b"\x7f" * 128))
    assert model_fingerprint(model) != fp
    (model / "model.safetensors").write_bytes(safetensors_bytes([4, 8]))
    assert model_fingerprint(model) == fp


def _saved(model: Any, d: Path) -> Path:
    """``model``'s weights as mlx-lm saves them, with a config, in ``d``."""
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    model.save_weights(str(d / "model.safetensors"))
    return d


def test_models_of_one_layout_with_other_weights_differ(tmp_path: Path) -> None:
    """Real safetensors files (mx.save_safetensors): a tiny llama with other
    random weights, and one whose layer-1 q_proj alone changed (what fusing
    a LoRA adapter into a few layers does) each get their own fingerprint;
    the same weights saved again get the same."""
    import mlx.core as mx

    from .tiny import tiny_llama

    base = model_fingerprint(_saved(tiny_llama(seed=0), tmp_path / "a"))
    assert model_fingerprint(_saved(tiny_llama(seed=0), tmp_path / "a2")) == base
    assert model_fingerprint(_saved(tiny_llama(seed=1), tmp_path / "b")) != base
    tuned = tiny_llama(seed=0)
    q = tuned.layers[1].self_attn.q_proj
    q.weight = q.weight + mx.full(q.weight.shape, 0.01, q.weight.dtype)
    assert model_fingerprint(_saved(tuned, tmp_path / "c")) != base


def test_other_weight_formats_are_sampled(model: Path) -> None:
    fp = model_fingerprint(model)
    weights = model / "pytorch_model.bin"
    weights.write_bytes(bytes(1 << 20))
    with_bin = model_fingerprint(model)
    assert with_bin != fp
    with open(weights, "r+b") as f:  # a block sampled: the file's last 4 KiB
        f.seek((1 << 20) - 100)
        f.write(b"\x01")
    assert model_fingerprint(model) != with_bin


def test_odd_weight_files_neither_hang_nor_raise(model: Path, tmp_path: Path) -> None:
    """A review's finds, each a fingerprint before values were sampled: a
    FIFO named like weights hung the read; offsets of 2**63 in a damaged
    header raised OverflowError; a weight file this user may not read (a
    root-owned training_args.bin) raised PermissionError. Now the FIFO is
    left out, the offsets read what is there, and the unreadable file
    counts by name and size."""
    import subprocess
    import sys
    import threading

    from .faultkit import NO_DAC, need_linux_root

    fp = model_fingerprint(model)
    for name in ("w.bin", "vocab.txt"):  # a weight file's name, a tokenizer file's
        os.mkfifo(model / name)
        got: list[str] = []
        reader = threading.Thread(target=lambda out=got: out.append(model_fingerprint(model)),
                                  daemon=True)
        reader.start()
        reader.join(30)
        assert got == [fp], f"a FIFO named {name} hung the fingerprint (or changed it)"
        (model / name).unlink()
    (model / "loop.bin").symlink_to(model / "loop.bin")
    with pytest.raises(ValueError, match="cannot read loop.bin: Too many levels"):
        model_fingerprint(model)  # (it raised OSError)
    (model / "loop.bin").unlink()
    header = json.dumps({"w": {"dtype": "F32", "shape": [1],
                               "data_offsets": [2**63, 2**63 + 4]}}).encode()
    (model / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"x" * 8)
    assert re.fullmatch(r"m-[0-9a-f]{32}", model_fingerprint(model))
    need_linux_root()
    secret = model / "training_args.bin"
    secret.write_bytes(b"t" * 100)
    secret.chmod(0o000)
    hidden = tmp_path / "blobs"  # a link into a directory this user may not enter
    hidden.mkdir()
    (hidden / "w").write_bytes(safetensors_bytes([2, 2]))
    hidden.chmod(0o000)
    (model / "model-2.safetensors").symlink_to(hidden / "w")

    def as_a_user() -> subprocess.CompletedProcess[str]:
        # As root without the right to pass file permissions: an ordinary user.
        code = "import sys; from kvkeeper import model_fingerprint as f; print(f(sys.argv[1]))"
        return subprocess.run([*NO_DAC, sys.executable, "-c", code, str(model)],
                              capture_output=True, text=True, timeout=60,
                              cwd=Path(__file__).parents[1])

    r = as_a_user()
    assert r.returncode == 0, r.stderr  # (PermissionError, both)
    assert re.fullmatch(r"m-[0-9a-f]{32}", r.stdout.strip())
    (model / "tokenizer.json").chmod(0o000)  # the tokenizer cannot load either
    r = as_a_user()
    assert r.returncode == 1 and "ValueError" in r.stderr and "cannot read tokenizer.json" \
        in r.stderr, r.stderr


def test_links_to_one_directory_fingerprint_alike_in_any_listing_order(tmp_path: Path) -> None:
    """Two copies of a model whose ``a`` and ``b`` link to one directory of
    weights, made in opposite orders: whichever link the walk met first was
    kept, and a directory's listing order follows its creation (tmpfs) or a
    per-file-system hash (ext4), so the copies differed (a review's find)."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path  # lists by creation
    fps = []
    for order in (("a", "b"), ("b", "a")):
        d = Path(tempfile.mkdtemp(dir=base))
        try:
            (d / "shared").mkdir()
            (d / "shared" / "model.safetensors").write_bytes(safetensors_bytes([4, 8]))
            m = d / "model"
            m.mkdir()
            (m / "config.json").write_text("{}")
            for name in order:
                (m / name).symlink_to(d / "shared", target_is_directory=True)
            fps.append(model_fingerprint(m))
        finally:
            shutil.rmtree(d)
    assert fps[0] == fps[1]


def test_reads_only_samples_of_weight_bodies(model: Path) -> None:
    """A 64 GiB sparse weight file (header valid, body a hole), a 64 GiB
    .gguf, and one whose body is cut off: each fingerprints after reading a
    few KiB (Linux counts the bytes a process reads in /proc/self/io)."""
    big = model / "model.safetensors"
    big.write_bytes(safetensors_bytes([4, 8]))
    os.truncate(big, 64 << 30)
    with open(model / "model.gguf", "wb") as f:
        f.truncate(64 << 30)
    full = safetensors_bytes([1024, 1024])
    (header_len,) = struct.unpack("<Q", full[:8])
    (model / "model-2.safetensors").write_bytes(full[: 8 + header_len])  # 4 MiB body missing

    def bytes_read() -> int:  # (0 where the kernel does not count them: macOS)
        io = Path("/proc/self/io")
        if not io.exists():
            return 0
        text = io.read_text()
        return int(re.search(r"^rchar: (\d+)$", text, re.M).group(1))  # type: ignore[union-attr]

    before = bytes_read()
    fp = model_fingerprint(model)
    assert re.fullmatch(r"m-[0-9a-f]{32}", fp)
    assert bytes_read() - before < 1 << 20


def test_clear_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        model_fingerprint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        model_fingerprint(tmp_path / "empty")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        model_fingerprint(tmp_path / "file")
    # "": the working directory's fingerprint, were it a model (an unset variable).
    (tmp_path / "empty" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path / "empty")
    with pytest.raises(ValueError, match="model path is empty"):
        model_fingerprint("")


def test_the_model_code_config_json_names_changes_it(model: Path) -> None:
    """mlx-lm and mlx-vlm build a model from the Python file config.json
    names as model_file (trust_remote_code). Another version of that code
    computes other keys from the same weights, and had the fingerprint of
    the first: each took the other's caches. Other .py files do not count."""
    fp = model_fingerprint(model)
    (model / "modeling_other.py").write_text("print('unused')\n")
    assert model_fingerprint(model) == fp
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_file": "arch.py"}))
    missing = model_fingerprint(model)
    assert missing != fp
    (model / "arch.py").write_text("class Model: pass\n")
    first = model_fingerprint(model)
    (model / "arch.py").write_text("class Model: scale = 2\n")
    second = model_fingerprint(model)
    assert len({fp, missing, first, second}) == 4
    (model / "arch.py").write_text("class Model: pass\n")
    assert model_fingerprint(model) == first
    (model / "arch.py").unlink()
    os.mkfifo(model / "arch.py")  # not read: it would hang
    assert model_fingerprint(model) not in (fp, missing, first, second)


@pytest.mark.parametrize(
    "content",
    [b"", b"\x01\x02", struct.pack("<Q", 1 << 40) + b"{}", struct.pack("<Q", 50) + b"{}"],
    ids=["empty", "short", "huge-length", "header-past-end"],
)
def test_broken_safetensors_header(model: Path, content: bytes) -> None:
    (model / "model.safetensors").write_bytes(content)
    with pytest.raises(ValueError, match="safetensors"):
        model_fingerprint(model)


def test_symlinked_files_and_loops(model: Path, tmp_path: Path) -> None:
    # A Hugging Face snapshot is a directory of symlinks into a blob store.
    fp = model_fingerprint(model)
    blobs = tmp_path / "blobs"
    shutil.copytree(model, blobs)
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    for f in blobs.iterdir():
        (snapshot / f.name).symlink_to(f)
    (snapshot / "loop").symlink_to(snapshot, target_is_directory=True)
    assert model_fingerprint(snapshot) == fp


@pytest.mark.parametrize("name", ["model-00002-of-00002.safetensors", "tokenizer.json"])
def test_a_broken_symlink_is_named(model: Path, tmp_path: Path, name: str) -> None:
    """An unfinished Hugging Face download: a link to a blob not there yet.
    It raised a bare FileNotFoundError, which the docstring gives for a
    missing model directory."""
    (model / name).unlink(missing_ok=True)
    (model / name).symlink_to(tmp_path / "blobs" / "not-yet")
    with pytest.raises(ValueError, match=f"{name} is a broken symlink"):
        model_fingerprint(model)


def _adapter(d: Path, scale: float, body: bytes) -> Path:
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "lora",
                                                       "lora_parameters": {"scale": scale}}))
    (d / "adapters.safetensors").write_bytes(safetensors_bytes([2, 2], body))
    return d


def test_an_unfused_adapter_gets_a_fingerprint_of_its_own(model: Path, tmp_path: Path) -> None:
    """mlx_lm.load(base, adapter_path=ad) gave the base model's fingerprint
    (the adapter lives outside the model directory), and model_fingerprint(ad)
    raised (no config.json): every adapter shared the base model's caches."""
    base = model_fingerprint(model)
    a = _adapter(tmp_path / "a", 20.0, b"\1" * 16)
    fp_a = model_fingerprint(model, adapter_path=a)
    assert fp_a != base and fp_a == model_fingerprint(model, adapter_path=str(a))
    assert re.fullmatch(r"m-[0-9a-f]{32}", fp_a)
    other_scale = _adapter(tmp_path / "b", 10.0, b"\1" * 16)
    other_weights = _adapter(tmp_path / "c", 20.0, b"\2" * 16)
    assert len({fp_a, model_fingerprint(model, adapter_path=other_scale),
                model_fingerprint(model, adapter_path=other_weights)}) == 3
    (tmp_path / "empty").mkdir()
    for not_one in (tmp_path / "empty", tmp_path / "missing", model):
        with pytest.raises(ValueError, match="is not a LoRA adapter directory"):
            model_fingerprint(model, adapter_path=not_one)
