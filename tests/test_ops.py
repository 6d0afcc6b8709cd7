"""Operations through the real CLI against a real daemon: settings, stats, ls,
rm, gc and the disk budget, verify, import/export, the service files."""

from __future__ import annotations

import json
import logging
import os
import plistlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache

import kvkeeper
from kvkeeper.client.client import Client, DaemonError

from .conftest import (
    WAIT,
    RunningDaemon,
    daemon_log,
    ping,
    serve_process,
    start_daemon,
    stop_process,
    wait_for,
    wait_for_log,
)
from .faultkit import FP, entry_path, filled, need_linux_root, small_tmpfs, tmp_files, version_of
from .legacy_describe import MLX_LM_OLD_API, describe
from .test_legacy import MANIFEST, ROOT
from .tiny import prefill, prompt, tiny_deepseek_v41, tiny_llama

MiB = 2**20


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvkeeper.cli", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


def test_print_config_precedence(short_dir: Path) -> None:
    cfg = short_dir / "kv.toml"
    cfg.write_text('max_disk_bytes = "3G"\nmin_free_bytes = "1G"\ndrain_timeout = 7\n')
    r = cli("serve", "--config", str(cfg), "--print-config", "--min-free-bytes", "2G",
            env={"KVKEEPER_DRAIN_TIMEOUT": "9", "KVKEEPER_ROOT": str(short_dir / "envroot")})
    assert r.returncode == 0, r.stderr
    lines = {line.split()[0]: line for line in r.stdout.splitlines()}
    assert "2147483648" in lines["min_free_bytes"] and "flag --min-free-bytes" in lines["min_free_bytes"]
    assert "9.0" in lines["drain_timeout"] and "environment KVKEEPER_DRAIN_TIMEOUT" in lines["drain_timeout"]
    assert "3221225472" in lines["max_disk_bytes"] and f"config file {cfg}" in lines["max_disk_bytes"]
    assert str(short_dir / "envroot") in lines["root"] and "environment KVKEEPER_ROOT" in lines["root"]
    assert "(default)" in lines["max_pending_bytes"]
    bad = short_dir / "bad.toml"
    bad.write_text("max_disk_bites = 1\n")
    r = cli("serve", "--config", str(bad), "--print-config")
    assert r.returncode == 2 and "unknown settings ['max_disk_bites']" in r.stderr


def test_stats_ls_rm_gc_through_the_cli(client: Client, daemon: RunningDaemon) -> None:
    sock = str(daemon.socket)
    for i in range(3):
        assert client.save("m1", f"s{i}", filled(0.5, i), [i] * (i + 1))
    assert client.save("m2", "other", filled(0.5, 9), [9])
    assert client.flush(timeout=WAIT)
    stats = json.loads(cli("stats", "--socket", sock, "--json").stdout)
    assert stats["saves_written"] == 4 and "write_seconds_p99" in stats
    assert stats["disk_used_bytes"] > 2 * MiB
    human = cli("stats", "--socket", sock).stdout
    assert "saves_written" in human and "Disk" in human
    listed = json.loads(cli("ls", "--socket", sock, "--json", "--sort", "tokens").stdout)
    assert [e["cache_id"] for e in listed] == ["s2", "s1", "s0", "other"]
    only = json.loads(cli("ls", "--socket", sock, "--json", "--model", "m2").stdout)
    assert [e["cache_id"] for e in only] == ["other"]
    table = cli("ls", "--socket", sock).stdout
    assert "s0" in table and "m2" in table
    assert cli("rm", "--socket", sock, "--model", "m1").returncode == 0
    assert [e.cache_id for e in client.entries()] == ["other"]
    assert cli("rm", "--socket", sock).returncode == 2  # a usage error: says what to give
    gc = json.loads(cli("gc", "--socket", sock, "--json").stdout)
    assert gc["evicted"] == [] and gc["disk_used_bytes"] > 0


def test_stats_table_places_every_counter_of_a_fresh_daemon(daemon: RunningDaemon) -> None:
    r = cli("stats", "--socket", str(daemon.socket))
    assert r.returncode == 0, r.stderr
    assert "Other" not in r.stdout, r.stdout  # each counter sits in its group
    boot = json.loads(cli("stats", "--socket", str(daemon.socket), "--json").stdout)["boot_id"]
    # An identifier, shown as one, and as --json and Client.stats() give it:
    # hex here and decimal there read as two daemons.
    row = next(line for line in r.stdout.splitlines() if "boot_id" in line)
    assert row.split() == ["boot_id", str(boot)], row


def test_budget_evicts_least_recently_used(short_dir: Path) -> None:
    root = short_dir / "root"
    rd = start_daemon(root, short_dir / "run" / "kv.sock", max_disk_bytes=int(3.5 * MiB))
    try:
        with Client(rd.socket, timeout=WAIT) as kv:
            # A foreign file counts against the budget but is never deleted.
            (root / "sessions" / "notes.txt").write_bytes(b"x" * 100_000)
            assert kv.gc().entries == []
            for name in ("a", "b", "c"):
                assert kv.save(FP, name, filled(1, 1), [1]) and kv.flush(timeout=WAIT)
                time.sleep(0.01)
            assert kv.load(FP, "a") is not None  # a load is a use: "a" is now the newest
            b_bytes = entry_path(root, "b").stat().st_size
            assert kv.save(FP, "d", filled(1, 1), [1]) and kv.flush(timeout=WAIT)
            left = {e.cache_id for e in kv.entries()}
            assert left == {"a", "c", "d"}, left
            stats = kv.stats()
            assert stats["evictions"] == 1 and stats["disk_used_bytes"] <= 3.5 * MiB
            assert stats["bytes_evicted"] == b_bytes  # the file of "b", whole
            # Nothing was pending, so the client read "a" itself and told the daemon.
            assert stats["loads_direct"] == 1 and stats.get("loads_found", 0) == 0
            everything = kv.entries(everything=True)
            assert any(e.kind == "foreign" and e.path.endswith("notes.txt") for e in everything)
        assert rd.stop() == 0
        # At start, with a smaller budget: the order survived the restart (atime).
        rd = start_daemon(root, short_dir / "run" / "kv.sock", max_disk_bytes=int(2.5 * MiB))
        with Client(rd.socket, timeout=WAIT) as kv:
            assert {e.cache_id for e in kv.entries()} == {"a", "d"}
        assert (root / "sessions" / "notes.txt").exists()
    finally:
        if rd.thread.is_alive():
            rd.stop()


def test_the_budget_deletes_only_files_of_the_daemon_and_old_caches(short_dir: Path) -> None:
    """Any file in <root>/quarantine/ was taken for one the daemon moved aside,
    and any safetensors file at an entry's place (model weights) for an old
    cache: both were evicted first. Only names the daemon gives in quarantine/
    and caches of a known format (here mlx-lm's) are its to delete."""
    root = short_dir / "root"
    (root / "quarantine").mkdir(parents=True, mode=0o700)
    os.chmod(root, 0o700)
    (root / "quarantine" / "notes.txt").write_bytes(b"n" * 300_000)
    (root / "quarantine" / "backup.2024010112").write_bytes(b"b" * 1000)
    # A time stamp's 19 digits after a name that is no entry's place (a
    # user's copy, kept for later): these were deleted as moved aside.
    lookalikes = ["weights.safetensors.1700000000000000000",
                  "my model.a.safetensors.1700000000000000000",
                  "x.y.z.safetensors.1700000000000000000"]
    for name in lookalikes:
        (root / "quarantine" / name).write_bytes(b"w" * 1000)
    (root / "sessions" / "weights").mkdir(parents=True)
    weights = root / "sessions" / "weights" / "model.safetensors"
    mx.save_safetensors(str(weights), {"w": mx.ones((256, 256))}, {"format": "mlx"})
    old_cache = root / "sessions" / FP / "old.safetensors"
    old_cache.parent.mkdir()
    shutil.copyfile(ROOT / "mlx-lm" / "kv.safetensors", old_cache)
    rd = start_daemon(root, short_dir / "run" / "kv.sock", max_disk_bytes=int(0.5 * MiB))
    try:
        with Client(rd.socket, timeout=WAIT) as kv:
            kinds = {Path(e.path).name: e.kind for e in kv.entries(everything=True)}
            assert kinds == {"notes.txt": "foreign", "backup.2024010112": "foreign",
                             "model.safetensors": "foreign",
                             **dict.fromkeys(lookalikes, "foreign")}, kinds
            assert kv.save(FP, "a", filled(0.1, 1), [1]) and kv.flush(timeout=WAIT)
            # Still over the budget: what it can delete is its own entry.
            assert [(e.cache_id, e.kind) for e in kv.gc().entries] == [("a", "entry")]
    finally:
        assert rd.stop() == 0
    assert (root / "quarantine" / "notes.txt").read_bytes() == b"n" * 300_000
    assert (root / "quarantine" / "backup.2024010112").exists()
    assert all((root / "quarantine" / name).exists() for name in lookalikes)
    assert mx.array_equal(mx.load(str(weights))["w"], mx.ones((256, 256)))
    assert not old_cache.exists()  # evicted at start, as an entry would be


def test_a_direct_load_counts_at_once_for_other_clients(short_dir: Path) -> None:
    """A load that reads the file itself tells the daemon at once: left for
    the I/O thread's next idle pass (up to 0.2 s), another client's save
    evicted the entry just loaded, and a process ending in os._exit (as
    multiprocessing's children do) took the use with it."""
    root = short_dir / "root"
    rd = start_daemon(root, short_dir / "run" / "kv.sock", max_disk_bytes=int(3.5 * MiB))
    try:
        with Client(rd.socket, timeout=WAIT) as writer, Client(rd.socket, timeout=WAIT) as reader:
            for name in ("a", "b", "c"):
                assert writer.save(FP, name, filled(1, 1), [1]) and writer.flush(timeout=WAIT)
                time.sleep(0.01)
            before = writer.stats()["loads_direct"]
            assert reader.load(FP, "a", verify=False) is not None  # read directly
            # The use told (a fixed 0.05 s stood for this: a reader's I/O
            # thread late to run let d's save evict a).
            wait_for(lambda: writer.stats()["loads_direct"] == before + 1, "a's use to be told")
            assert writer.save(FP, "d", filled(1, 1), [1]) and writer.flush(timeout=WAIT)
            assert {e.cache_id for e in writer.entries()} == {"a", "c", "d"}
            # What checks "at once": a child that loads and ends in os._exit
            # 0.05 s later. A notice left for the idle pass (up to 0.2 s) dies
            # with it about 3 times in 4, so three children.
            code = (f"import os, time\nfrom kvkeeper import Client\n"
                    f"kv = Client({str(rd.socket)!r}, timeout=30)\n"
                    f"assert kv.load({FP!r}, 'c', verify=False) is not None\n"
                    f"time.sleep(0.05)\nos._exit(0)\n")
            for _ in range(3):
                before = writer.stats()["loads_direct"]
                r = subprocess.run([sys.executable, "-c", code], capture_output=True,
                                   text=True, timeout=WAIT)
                assert r.returncode == 0, r.stderr
                # Sent before the child ended, read by the daemon in its turn.
                wait_for(lambda b=before: writer.stats()["loads_direct"] == b + 1,
                         "the child's use to be counted")
    finally:
        rd.stop()


def test_a_save_whose_metadata_takes_it_past_the_disk_budget_is_refused(
    short_dir: Path,
) -> None:
    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock",
                      max_disk_bytes=1_700_000)
    try:
        with Client(rd.socket, timeout=WAIT) as kv:
            assert kv.save(FP, "a", filled(0.25, 1), [1]) and kv.flush(timeout=WAIT)
            # 1 MiB of data fits the 1.7 MB budget; its 150,000 token ids
            # (about 1 MiB more in the header) do not. Written, it would evict "a"
            # and still be over the budget alone.
            assert kv.save(FP, "b", filled(1, 2), [100_000] * 150_000)
            assert kv.flush(timeout=WAIT) is False
            assert {e.cache_id for e in kv.entries()} == {"a"}
            assert not entry_path(rd.root, "b").exists()
            assert version_of(entry_path(rd.root, "a")) == 1
            assert kv.stats()["saves_refused"] == 1
            # 250,000 characters of text take 750,000 bytes in UTF-8: over.
            assert kv.save(FP, "c", filled(1, 3), [1], metadata={"note": "中" * 250_000})
            # 100,000 control characters: 600,000 bytes as they travel (the
            # client JSON-encodes user metadata), which fits; about 700,000
            # in the file's header (escaped again), which does not. Only the
            # writer, which encodes the header, can tell.
            assert kv.save(FP, "d", filled(1, 4), [1], metadata={"note": "\x01" * 100_000})
            assert kv.flush(timeout=WAIT) is False
            assert kv.stats()["saves_refused"] + kv.stats()["saves_failed"] == 3
            assert {e.cache_id for e in kv.entries()} == {"a"}
            assert not entry_path(rd.root, "c").exists()
            assert not entry_path(rd.root, "d").exists()
    finally:
        rd.stop()


def test_min_free_bytes_on_a_small_disk(short_dir: Path) -> None:
    with small_tmpfs(short_dir, "8m") as mnt:
        rd = start_daemon(mnt / "root", short_dir / "run" / "kv.sock", min_free_bytes=5 * MiB)
        try:
            with Client(rd.socket, timeout=WAIT) as kv:
                for name in ("a", "b", "c"):
                    assert kv.save(FP, name, filled(1, 1), [1]) and kv.flush(timeout=WAIT)
                assert {e.cache_id for e in kv.entries()} == {"b", "c"}
                assert kv.stats()["evictions"] == 1
        finally:
            rd.stop()


def test_the_budget_evicts_what_is_there_now_not_what_was_indexed(short_dir: Path) -> None:
    """Files changed by hand while the daemon runs: model weights moved over an
    entry's file were deleted by the next eviction, as the entry they replaced;
    an entry's file removed by hand still counted, so a live entry went for it.
    The weights are now counted (never deleted) and the removed file is not."""
    from safetensors.numpy import load_file, save_file

    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock",
                      max_disk_bytes=int(3.5 * MiB))
    try:
        with Client(rd.socket, timeout=WAIT) as kv:
            for name in ("old", "gone", "live"):
                assert kv.save(FP, name, filled(1, 1), [1]) and kv.flush(timeout=WAIT)
            weights = {"w": np.arange(64, dtype=np.float32)}
            spare = short_dir / "root" / "w.safetensors"
            save_file(weights, str(spare), metadata={"format": "pt"})
            os.replace(spare, entry_path(rd.root, "old"))
            entry_path(rd.root, "gone").unlink()
            # 2 MiB more: with "gone" counted and the weights taken for "old",
            # "old" and "live" were deleted to make room.
            assert kv.save(FP, "new", filled(2, 2), [2]) and kv.flush(timeout=WAIT)
            assert np.array_equal(load_file(str(entry_path(rd.root, "old")))["w"], weights["w"])
            assert version_of(entry_path(rd.root, "live")) == 1
            assert version_of(entry_path(rd.root, "new")) == 2
            assert kv.stats()["evictions"] == 0
            assert {e.cache_id for e in kv.entries()} == {"live", "new"}
            assert [e.kind for e in kv.entries(everything=True)
                    if e.path == str(entry_path(rd.root, "old"))] == ["foreign"]
    finally:
        rd.stop()


def test_a_save_too_big_for_the_disk_evicts_nothing(short_dir: Path) -> None:
    """A save that would not fit even with every entry gone evicted them all
    first, and then failed with ENOSPC all the same."""
    with small_tmpfs(short_dir, "12m") as mnt:
        rd = start_daemon(mnt / "root", short_dir / "run" / "kv.sock", min_free_bytes=MiB)
        try:
            with Client(rd.socket, timeout=WAIT) as kv:
                for name in ("a", "b"):
                    assert kv.save(FP, name, filled(2, 1), [1]) and kv.flush(timeout=WAIT)
                assert kv.save(FP, "huge", filled(16, 2), [2])
                assert kv.flush(timeout=WAIT) is False
                assert kv.stats()["evictions"] == 0
                # The disk is not short of --min-free-bytes: the save was too big
                # (a review: the pass before its write said below_min_free 1).
                assert kv.stats()["below_min_free"] == 0.0
                assert {e.cache_id for e in kv.entries()} == {"a", "b"}
                assert version_of(entry_path(rd.root, "a")) == 1
                assert tmp_files(rd.root) == []
        finally:
            rd.stop()


def test_a_full_disk_makes_room_with_min_free_bytes_0(short_dir: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """--min-free-bytes 0 turned the check before a write off: on a full disk
    a save failed with ENOSPC while older entries could have made room. The
    evictions were logged with reason=min_free_bytes, a setting of 0."""
    caplog.set_level(logging.INFO, logger="kvkeeper")
    with small_tmpfs(short_dir, "8m") as mnt:
        rd = start_daemon(mnt / "root", short_dir / "run" / "kv.sock", min_free_bytes=0)
        try:
            with Client(rd.socket, timeout=WAIT) as kv:
                for i, name in enumerate("abcd"):
                    assert kv.save(FP, name, filled(2, i + 1), [i + 1]), name
                    assert kv.flush(timeout=WAIT), name
                assert kv.stats()["saves_failed"] == 0
                assert kv.stats()["evictions"] >= 1
                assert version_of(entry_path(rd.root, "d")) == 4
        finally:
            rd.stop()
    reasons = {r.getMessage().split(" reason=")[1].split()[0] for r in caplog.records
               if "event=evicted" in r.getMessage()}
    assert reasons == {"room_for_save"}, caplog.text


def test_a_disk_filled_by_other_files_is_warned_of(short_dir: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """With --min-free-bytes beyond what evicting entries can free (another
    file fills the disk), every write evicts the entries before it: the log
    says so, as a warning, and stats says below_min_free 1 (two reviews: the
    store kept one cache, and only the daemon's log told why) until space is
    freed. The first pass that finds the disk short says so too, before any
    eviction. (More than the whole disk is refused at start.)"""
    caplog.set_level(logging.INFO, logger="kvkeeper")
    with small_tmpfs(short_dir, "8m") as mnt:
        (mnt / "other").write_bytes(b"x" * (5 * MiB))
        rd = start_daemon(mnt / "root", short_dir / "run" / "kv.sock", min_free_bytes=3 * MiB)
        try:
            with Client(rd.socket, timeout=WAIT) as kv:
                assert kv.save(FP, "a", filled(1, 1), [1]) and kv.flush(timeout=WAIT)
                # Nothing evicted yet, and said all the same (before: nothing
                # until the first eviction).
                [first] = [r.getMessage() for r in caplog.records
                           if "event=below_min_free" in r.getMessage()]
                assert " evicted=0 " in first, first
                assert kv.stats()["below_min_free"] == 1.0
                assert kv.save(FP, "b", filled(1, 2), [2]) and kv.flush(timeout=WAIT)
                assert {e.cache_id for e in kv.entries()} == {"b"}
                shown = cli("stats", "--socket", str(rd.socket)).stdout
                assert re.search(r"below_min_free\s+1\b", shown), shown
                (mnt / "other").unlink()
                assert kv.save(FP, "c", filled(1, 3), [3]) and kv.flush(timeout=WAIT)
                assert kv.stats()["below_min_free"] == 0.0
                assert {e.cache_id for e in kv.entries()} == {"b", "c"}
        finally:
            rd.stop()
    warned = [r for r in caplog.records if "event=below_min_free" in r.getMessage()]
    assert len(warned) == 2, caplog.text  # as it began, and with b's eviction of a
    assert all(r.levelname == "WARNING" for r in warned), caplog.text
    assert f"min_free_bytes={3 * MiB}" in warned[0].getMessage()
    assert " evicted=1 " in warned[1].getMessage()
    evicted = [r.getMessage() for r in caplog.records if "event=evicted" in r.getMessage()]
    assert len(evicted) == 1 and " reason=min_free_bytes " in evicted[0], evicted


def test_ls_piped_shows_long_ids_whole_and_stats_says_no_disk_limit(short_dir: Path) -> None:
    """Piped, the table is 80 columns wide: a long id ended in "…", though ls
    shows ids to be copied into rm; and a daemon with no disk limit showed
    max_disk_bytes "0 B"."""
    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock", max_disk_bytes=None)
    try:
        long_id = "session-" + "0123456789" * 8
        with Client(rd.socket, timeout=WAIT) as kv:
            assert kv.save(FP, long_id, filled(0.1, 1), [1]) and kv.flush(timeout=WAIT)
        table = cli("ls", "--socket", str(rd.socket)).stdout
        assert "…" not in table
        column = [line.split("│")[2].strip() for line in table.splitlines() if "│" in line]
        assert "".join(column) == long_id, table
        shown_stats = cli("stats", "--socket", str(rd.socket)).stdout
        line = next(x for x in shown_stats.splitlines() if "max_disk_bytes" in x)
        assert line.split()[-1] == "none", line
    finally:
        assert rd.stop() == 0


def test_stats_say_what_is_free_on_the_disk_of_sessions(short_dir: Path) -> None:
    """The free space the daemon keeps is on sessions/'s disk, which may be
    one of its own; a ramfs has no size, and the daemon keeps nothing free
    there. Only the daemon can tell either from another mount namespace."""
    root = short_dir / "root"
    root.mkdir(mode=0o700)
    with small_tmpfs(root, "16m", name="sessions") as sessions:
        rd = start_daemon(root, short_dir / "run" / "kv.sock")
        try:
            with Client(rd.socket, timeout=WAIT) as kv:
                assert kv.save(FP, "a", filled(2, 1), [1]) and kv.flush(timeout=WAIT)
                assert kv.stats()["free_bytes"] == shutil.disk_usage(sessions).free
            assert shutil.disk_usage(sessions).free < 14 * MiB < shutil.disk_usage(root).free
        finally:
            assert rd.stop() == 0
    with small_tmpfs(short_dir, "ramfs") as mnt:
        # With the default min_free_bytes, which was refused there as more
        # than the whole file system (0 bytes), so serve did not start.
        proc = serve_process(mnt / "root", short_dir / "run" / "kv.sock")
        sock = str(short_dir / "run" / "kv.sock")
        try:
            with Client(sock, timeout=WAIT) as kv:
                assert kv.stats()["free_bytes"] == -1
                assert kv.gc().free_bytes == -1  # was 0
            shown = cli("stats", "--socket", sock).stdout
            assert next(x for x in shown.splitlines() if "free_bytes" in x).split() == \
                ["free_bytes", "unknown"], shown
            shown = cli("gc", "--socket", sock).stdout
            assert "; unknown free on the store's file system" in shown, shown
        finally:
            assert stop_process(proc) == 0


def test_junk_at_an_entrys_place_is_that_entrys_damaged_file(
    client: Client, daemon: RunningDaemon
) -> None:
    """Bytes that are no safetensors file at all, under an entry's name: a load
    moves them aside and a save replaces them, so ``ls --all`` must not call
    them another program's file ("foreign": never deleted). It listed them so;
    they are the key's entry, as a damaged file of kvkeeper's is."""
    assert client.save(FP, "ok", filled(0.1, 1), [1]) and client.flush(timeout=WAIT)
    junk = entry_path(daemon.root, "junk")
    junk.write_bytes(b"not a safetensors file")
    client.gc()
    rows = json.loads(cli("ls", "--socket", str(daemon.socket), "--all", "--json").stdout)
    assert {(r["cache_id"], r["kind"]) for r in rows if r["path"] == str(junk)} == {("junk", "entry")}
    assert {e.cache_id for e in client.entries()} == {"ok", "junk"}
    assert client.load(FP, "junk") is None
    assert not junk.exists() and len(list((daemon.root / "quarantine").iterdir())) == 1
    assert {e.cache_id for e in client.entries()} == {"ok"}


def _fp8_weights(path: Path, n: int) -> None:
    """A safetensors file as torch writes FP8 weights: a dtype kvkeeper's
    reader does not know, which the safetensors package opens."""
    import struct

    header = json.dumps({"__metadata__": {"format": "pt"},
                         "w": {"dtype": "F8_E4M3", "shape": [n], "data_offsets": [0, n]}})
    raw = header.encode() + b" " * (-(8 + len(header)) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + os.urandom(n))
    from safetensors import safe_open
    with safe_open(str(path), "np") as f:
        assert list(f.keys()) == ["w"]


def test_weights_of_a_dtype_kvkeeper_does_not_know_are_never_deleted(short_dir: Path) -> None:
    """FP8 weights named like an entry: kvkeeper's reader refuses their dtype,
    and that was taken for a damaged cache, so the disk budget deleted them
    at start and rm --model deleted them (and a save of that key replaced
    them). A cache of kvkeeper's cut short is still that entry's, damaged
    (the budget deletes it)."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    weights = entry_path(root, "weights")
    root.mkdir(mode=0o700)
    _fp8_weights(weights, 100_000)
    before = weights.read_bytes()
    rd = start_daemon(root, sock, max_disk_bytes=50_000)  # the weights alone are over it
    running = True
    try:
        assert weights.read_bytes() == before
        rows = json.loads(cli("ls", "--socket", str(sock), "--all", "--json").stdout)
        assert [(r["path"], r["kind"]) for r in rows] == [(str(weights), "foreign")]
        r = cli("rm", "--model", FP, "--socket", str(sock))
        assert r.returncode == 1 and "no entries" in r.stderr, r
        with Client(sock, timeout=WAIT) as kv:
            assert kv.save(FP, "weights", filled(0.01, 1), [1])
            assert kv.flush(timeout=WAIT) is False  # left in place: not ours to replace
            assert weights.read_bytes() == before
            assert kv.save(FP, "cut", filled(0.01, 2), [2]) and kv.flush(timeout=WAIT)
            cut = entry_path(root, "cut")
            os.truncate(cut, cut.stat().st_size - 10)
            kv.gc()  # over the budget again: the damaged entry goes, the weights stay
            assert not cut.exists() and kv.stats()["evictions"] == 1
            assert [e.kind for e in kv.entries(everything=True)] == ["foreign"]
        # verify called them bad (unknown dtype), and its repair tried to move them.
        for daemon_up in (True, False):
            if not daemon_up:
                running, code = False, rd.stop()
                assert code == 0
            r = cli("verify", "--root", str(root), "--socket", str(sock), "--repair", "--json")
            report = json.loads(r.stdout)
            assert r.returncode == 0 and report["not_caches"] == [str(weights)], r
            assert report["bad"] == [] and weights.read_bytes() == before
    finally:
        if running:
            assert rd.stop() == 0
    assert weights.read_bytes() == before


def test_rm_model_deletes_what_it_can_and_names_what_it_left(
        client: Client, daemon: RunningDaemon) -> None:
    """One entry the daemon would not delete (another program's file put at
    its place while the daemon ran: still indexed as the entry) ended
    rm --model there: the entries after it were left, and the one deleted
    before it was not reported."""
    for cache_id in "pqrs":
        assert client.save(FP, cache_id, filled(0.1, 1), [1])
    assert client.flush(timeout=WAIT)
    weights = entry_path(daemon.root, "q")
    _fp8_weights(weights, 1000)
    before = weights.read_bytes()
    r = cli("rm", "--model", FP, "--socket", str(daemon.socket))
    assert r.returncode == 1, r
    assert f"deleted 3 entries of model {FP}" in r.stdout, r.stdout
    said = " ".join(r.stderr.split())
    assert f"kvkeeper: not deleted: {FP} / q: " in said and "left in place" in said, said
    assert weights.read_bytes() == before
    assert not any(entry_path(daemon.root, c).exists() for c in "prs")


def _five_entries_deleted_slowly(short_dir: Path) -> tuple[
        Path, Path, subprocess.Popen[bytes]]:
    """A daemon (root, socket, process) holding entries p, q, r, s, t of FP,
    that waits 1 s before each delete's unlink."""
    from kvkeeper.daemon.faults import ENV

    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock, env={ENV: "delete_delay=1"})
    try:
        with Client(sock, timeout=WAIT) as kv:
            for cache_id in "pqrst":
                assert kv.save(FP, cache_id, filled(0.1, 1), [1])
            assert kv.flush(timeout=WAIT)
    except BaseException:
        stop_process(proc)
        raise
    return root, sock, proc


def _rm_model_as_the_daemon_stops(short_dir: Path, signum: int) -> tuple[int, str, str]:
    """rm --model of entries p, q, r, s, t (1 s before each unlink), the
    daemon sent ``signum`` once the second delete's delay has begun (p gone,
    its answer sent); rm's exit status, stdout, stderr."""
    root, sock, proc = _five_entries_deleted_slowly(short_dir)
    try:
        rm = subprocess.Popen([sys.executable, "-m", "kvkeeper.cli", "rm", "--model", FP,
                               "--socket", str(sock)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
        # The second delete's delay begun: rm has had the first's answer
        # (waiting for p's file to go raced that answer, sent just after).
        wait_for_log(proc, "step=delete_delay", "the second delete", count=2)
        assert not entry_path(root, "p").exists()
        proc.send_signal(signum)  # while the second waits out its delay
        out, errors = rm.communicate(timeout=WAIT)
    finally:
        if proc.poll() is None or signum == signal.SIGTERM:
            assert stop_process(proc) == 0
    return rm.returncode, out, errors


def test_rm_model_stopped_by_ctrl_c_says_what_it_deleted(short_dir: Path) -> None:
    """Ctrl-C during rm --model said "kvkeeper: interrupted" alone (exit
    130): which entries were gone, which not, nothing said."""
    from .test_cli_checks import _interrupted

    root, sock, proc = _five_entries_deleted_slowly(short_dir)
    try:
        # Pressed as the second delete waits out its delay (p gone, its answer sent).
        status, out, err = _interrupted(
            ["rm", "--model", FP, "--socket", str(sock)],
            lambda: daemon_log(proc).count("step=delete_delay") >= 2)
    finally:
        assert stop_process(proc) == 0
    assert status == 130, (out, err)
    assert f"deleted 1 entry of model {FP}" in out, out
    said = err.splitlines()
    assert said[0] == f"kvkeeper: not deleted: {FP} / q: interrupted: it may be deleted or " \
                      f"not (see kvkeeper ls)", said
    assert said[1:4] == [f"kvkeeper: not deleted: {FP} / {c}: not tried: interrupted"
                         for c in "rst"], said
    assert [line for line in said[4:] if line] == ["kvkeeper: interrupted"], said
    assert not entry_path(root, "p").exists()
    assert all(entry_path(root, c).exists() for c in "rst")


def test_rm_model_says_what_it_deleted_when_the_daemon_goes_away(short_dir: Path) -> None:
    """A daemon gone part way (stopped, restarted by a new install-service)
    ended rm --model with "no kvkeeper daemon", the deletes done unsaid."""
    code, out, errors = _rm_model_as_the_daemon_stops(short_dir, signal.SIGKILL)
    assert code == 3, (out, errors)
    assert f"deleted 1 entry of model {FP}" in out, out
    said = errors.splitlines()
    assert said[0].startswith(f"kvkeeper: not deleted: {FP} / q: not known whether deleted"), said
    assert said[1:4] == [f"kvkeeper: not deleted: {FP} / {c}: not tried: the daemon went away"
                         for c in "rst"], said
    assert "daemon" in said[4] and len(said) == 5, said
    assert all(entry_path(short_dir / "root", c).exists() for c in "rst")


def test_rm_model_says_which_deletes_a_draining_daemon_refused(short_dir: Path) -> None:
    """A daemon told to stop (SIGTERM) during rm --model finishes the delete
    it has begun and refuses the next: that one is not deleted (not "not
    known"), and the rest were not tried."""
    code, out, errors = _rm_model_as_the_daemon_stops(short_dir, signal.SIGTERM)
    assert code == 3, (out, errors)
    # The delete in flight when the signal came is finished, or, not begun
    # yet, refused: either way it is told as it went.
    gone = [c for c in "pqrst" if not entry_path(short_dir / "root", c).exists()]
    assert gone in (["p"], ["p", "q"]), gone
    assert f"deleted {len(gone)} {'entry' if len(gone) == 1 else 'entries'} of model {FP}" \
        in out, out
    kept = [c for c in "pqrst" if c not in gone]
    said = errors.splitlines()
    assert said[:-1] == [f"kvkeeper: not deleted: {FP} / {kept[0]}: the daemon is shutting "
                         f"down"] + [f"kvkeeper: not deleted: {FP} / {c}: not tried: the daemon "
                                     f"is shutting down" for c in kept[1:]], said
    assert "shutting down" in said[-1], said


def test_ls_all_shows_what_is_not_an_entry(client: Client, daemon: RunningDaemon) -> None:
    assert client.save(FP, "ok", filled(0.1, 1), [1]) and client.flush(timeout=WAIT)
    model_dir = entry_path(daemon.root, "ok").parent
    (model_dir / ".leftover.tmp").write_bytes(b"partial")
    shutil.copyfile(ROOT / "mlx-lm" / "kv.safetensors", model_dir / "old.safetensors")
    shutil.copyfile(ROOT / "mlx-lm-0.31" / "kv.safetensors", model_dir / "older.safetensors")
    client.gc()
    rows = json.loads(cli("ls", "--socket", str(daemon.socket), "--all", "--json").stdout)
    kinds = {Path(r["path"]).name: r["kind"] for r in rows}
    assert kinds == {"ok.safetensors": "entry", ".leftover.tmp": "foreign",
                     "old.safetensors": "legacy", "older.safetensors": "legacy"}
    table = cli("ls", "--socket", str(daemon.socket), "--all").stdout
    assert "foreign" in table and "1 entry, 3 other files" in table  # not "4 entries"
    assert "1 entry," in cli("ls", "--socket", str(daemon.socket)).stdout
    assert [e.cache_id for e in client.entries()] == ["ok"]
    # Files in a model's directory are listed with that model (the foreign
    # one had none, so --model left it out); a file outside any has none.
    (daemon.root / "notes.txt").write_bytes(b"n")
    client.gc()
    rows = json.loads(cli("ls", "--socket", str(daemon.socket), "--all", "--json",
                          "--model", FP).stdout)
    assert sorted(Path(r["path"]).name for r in rows) == [
        ".leftover.tmp", "ok.safetensors", "old.safetensors", "older.safetensors"]
    assert [e.model for e in client.entries(everything=True)
            if Path(e.path).name == "notes.txt"] == [""]


def test_ls_all_of_a_model_shows_its_quarantined_files(short_dir: Path) -> None:
    """Files moved aside had no model in the listing, so `ls --all --model X`
    never showed X's damaged files (a legacy file at X's place it did)."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    rd = start_daemon(root, sock)
    try:
        with Client(sock, timeout=WAIT) as kv:
            for model, cache_id in ((FP, "bad"), (FP, "ok"), ("other-model", "bad")):
                assert kv.save(model, cache_id, filled(0.1, 1), [1])
            assert kv.flush(timeout=WAIT)
            bad = entry_path(root, "bad")
            data = bytearray(bad.read_bytes())
            data[-1] ^= 1
            bad.write_bytes(bytes(data))
            assert kv.load(FP, "bad") is None  # moved aside
        assert not bad.exists()

        def listed(model: str) -> set[tuple[str, str, str]]:
            rows = json.loads(cli("ls", "--socket", str(sock), "--all", "--model", model,
                                  "--json").stdout)
            return {(r["model"], r["cache_id"], r["kind"]) for r in rows}

        mine = {(FP, "bad", "quarantine"), (FP, "ok", "entry")}
        assert listed(FP) == mine
        assert listed("other-model") == {("other-model", "bad", "entry")}
        assert rd.stop() == 0
        rd = start_daemon(root, sock)  # found again by the scan at start
        assert listed(FP) == mine
    finally:
        if rd.thread.is_alive():
            assert rd.stop() == 0


def test_verify_repair_by_root_of_another_users_store_moves_nothing(short_dir: Path) -> None:
    """Without a daemon, root's repair of a user's store made quarantine/
    root's (mode 0700), which that user's daemon could not use."""
    need_linux_root()
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    rd = start_daemon(root, sock)
    with Client(rd.socket, timeout=WAIT) as kv:
        assert kv.save(FP, "a", filled(0.1, 1), [1]) and kv.flush(timeout=WAIT)
    assert rd.stop() == 0
    bad = entry_path(root, "a")
    with open(bad, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    for path in [root, *root.rglob("*")]:
        os.lchown(path, 65534, 65534)
    r = cli("verify", "--root", str(root), "--repair")
    said = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 2 and f"{root} belongs to uid 65534: run verify --repair as that " \
        "user" in said, said
    assert "BAD" in said and bad.exists() and not (root / "quarantine").exists(), said


def test_verify_and_repair(client: Client, daemon: RunningDaemon) -> None:
    for name in ("good", "bad"):
        assert client.save(FP, name, filled(0.5, 3), [3])
    assert client.flush(timeout=WAIT)
    bad = entry_path(daemon.root, "bad")
    data = bytearray(bad.read_bytes())
    data[-1] ^= 1
    bad.write_bytes(bytes(data))
    r = cli("verify", "--socket", str(daemon.socket), "--json")
    assert r.returncode == 1, r.stderr
    report = json.loads(r.stdout)
    assert report["checked"] == 2 and [b["path"] for b in report["bad"]] == [str(bad)]
    assert "checksum mismatch" in report["bad"][0]["reason"]
    # Without --repair, the report says what would move them.
    r = cli("verify", "--socket", str(daemon.socket))
    # With the options that named this store (a review: without them, the
    # command as printed looked at another).
    assert r.returncode == 1 and f"(kvkeeper verify --repair --socket={daemon.socket} moves " \
        f"the bad ones aside" in " ".join(r.stdout.split()), r.stdout
    assert bad.exists()
    r = cli("verify", "--socket", str(daemon.socket), "--repair")
    assert r.returncode == 1 and "moved aside" in r.stdout
    assert "verify --repair moves" not in r.stdout, r.stdout
    assert not bad.exists() and version_of(entry_path(daemon.root, "good")) == 3
    assert cli("verify", "--socket", str(daemon.socket)).returncode == 0


def test_verify_repair_of_the_daemons_root_by_another_name_goes_through_it(
        client: Client, daemon: RunningDaemon, short_dir: Path) -> None:
    """--root naming the running daemon's store another way (a case of its
    name on APFS; a bind mount here) was taken for another store: the repair
    tried the direct way and was refused, the daemon holding the root."""
    from .faultkit import need_linux_root, run

    need_linux_root()
    assert client.save(FP, "bad", filled(0.5, 3), [3]) and client.flush(timeout=WAIT)
    bad = entry_path(daemon.root, "bad")
    data = bytearray(bad.read_bytes())
    data[-1] ^= 1
    bad.write_bytes(bytes(data))
    alias = short_dir / "alias"
    alias.mkdir(mode=0o700)
    run("mount", "--bind", str(daemon.root), str(alias))
    try:
        r = cli("verify", "--socket", str(daemon.socket), "--root", str(alias), "--repair",
                "--json")
    finally:
        run("umount", "-l", str(alias))
    assert r.returncode == 1, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert len(report["moved_aside"]) == 1 and "repair_error" not in report, report
    assert not bad.exists()


def test_verify_finds_damage_in_the_header_and_repairs_it(
    client: Client, daemon: RunningDaemon
) -> None:
    """A digit of the token ids and the format's name changed in place, every
    tensor's bytes intact: verify said "all good" for the first and skipped
    the second as another program's file (which the daemon never replaces)."""
    for name in ("good", "tokens", "format"):
        assert client.save(FP, name, filled(0.2, 3), [3])
    assert client.flush(timeout=WAIT)
    edits = {"tokens": (b'"kvkeeper.token_ids":"[3]"', b'"kvkeeper.token_ids":"[5]"'),
             "format": (b'"kvkeeper/1"', b'"kvkeeper/0"')}
    for name, (old, new) in edits.items():
        path = entry_path(daemon.root, name)
        data = path.read_bytes()
        assert data.count(old) == 1, data[:300]
        path.write_bytes(data.replace(old, new))
    r = cli("verify", "--socket", str(daemon.socket), "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    report = json.loads(r.stdout)
    reasons = {b["path"]: b["reason"] for b in report["bad"]}
    assert report["checked"] == 3 and set(reasons) == {
        str(entry_path(daemon.root, n)) for n in edits}, r.stdout
    assert all("header checksum mismatch" in why for why in reasons.values()), reasons
    r = cli("verify", "--socket", str(daemon.socket), "--repair", "--json")
    assert sorted(json.loads(r.stdout)["moved_aside"]) == sorted(reasons), r.stdout + r.stderr
    assert cli("verify", "--socket", str(daemon.socket)).returncode == 0
    assert version_of(entry_path(daemon.root, "good")) == 3
    assert client.save(FP, "format", filled(0.2, 4), [4]) and client.flush(timeout=WAIT)
    assert version_of(entry_path(daemon.root, "format")) == 4


def test_verify_repair_leaves_a_version_saved_after_the_check(
    client: Client, daemon: RunningDaemon
) -> None:
    """The check of a big store takes a while; a good version of a bad entry
    saved meanwhile (its load found it damaged, the app saved it anew) was
    the file the repair moved aside: it asked the daemon to move whatever
    sat at the path by then."""
    assert client.save(FP, "a", filled(0.2, 1), [1])
    for i in range(8):  # checked after "a", while the test saves "a" anew
        assert client.save(FP, f"z{i}", filled(64, 2), [2])
    assert client.flush(timeout=WAIT)
    bad = entry_path(daemon.root, "a")
    data = bytearray(bad.read_bytes())
    data[-1] ^= 1
    bad.write_bytes(bytes(data))
    # At nice 19: on a loaded machine this test's polling lost the race to a
    # verify at full speed once (it got through the later files first).
    proc = subprocess.Popen(["nice", "-n", "19", sys.executable, "-m", "kvkeeper.cli", "verify",
                             "--socket", str(daemon.socket), "--repair", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    zdir = str(bad.parent / "z")
    stopped = False
    try:
        deadline = time.monotonic() + WAIT
        while not stopped and proc.poll() is None:
            assert time.monotonic() < deadline, "verify never opened the later files"
            try:
                fds = os.listdir(f"/proc/{proc.pid}/fd")
            except FileNotFoundError:
                break
            for fd in fds:
                try:
                    target = os.readlink(f"/proc/{proc.pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith(zdir):  # "a" is judged: stop before the repair
                    proc.send_signal(signal.SIGSTOP)
                    stopped = True
                    break
        assert stopped, "verify ended before the test could stop it (no later file seen open)"
        assert client.save(FP, "a", filled(0.2, 3), [3]) and client.flush(timeout=WAIT)
    finally:
        proc.send_signal(signal.SIGCONT)
        out, errs = proc.communicate(timeout=WAIT)
    report = json.loads(out)
    assert proc.returncode == 1 and [b["path"] for b in report["bad"]] == [str(bad)], out + errs
    assert report["moved_aside"] == [], out
    assert version_of(bad) == 3
    assert client.load(FP, "a") is not None


def test_verify_finds_a_file_at_another_keys_place_and_repairs_hashed_names(
    client: Client, daemon: RunningDaemon
) -> None:
    """A copy of entry a's file at b's place verified "all good", though load()
    refuses it; and a damaged entry whose name is hashed (a long id) could not
    be moved aside while the daemon ran ("does not decode to an id")."""
    long_id = "L" * 100
    for name in ("a", "b", long_id):
        assert client.save(FP, name, filled(0.2, 3), [3])
    assert client.flush(timeout=WAIT)
    shutil.copyfile(entry_path(daemon.root, "a"), entry_path(daemon.root, "b"))
    hashed = entry_path(daemon.root, long_id)
    assert hashed.name.startswith("_z")
    data = bytearray(hashed.read_bytes())
    data[-1] ^= 1
    hashed.write_bytes(bytes(data))
    r = cli("verify", "--socket", str(daemon.socket), "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    reasons = {b["path"]: b["reason"] for b in json.loads(r.stdout)["bad"]}
    assert set(reasons) == {str(entry_path(daemon.root, "b")), str(hashed)}, reasons
    assert "belongs elsewhere" in reasons[str(entry_path(daemon.root, "b"))]
    r = cli("verify", "--socket", str(daemon.socket), "--repair", "--json")
    assert sorted(json.loads(r.stdout)["moved_aside"]) == sorted(reasons), r.stdout + r.stderr
    assert cli("verify", "--socket", str(daemon.socket)).returncode == 0
    assert version_of(entry_path(daemon.root, "a")) == 3
    # One whose header is gone too: the daemon, which moves files by key, is
    # not asked. That was said on stderr alone: --json listed it nowhere.
    assert client.save(FP, long_id, filled(0.2, 3), [3]) and client.flush(timeout=WAIT)
    os.truncate(hashed, 4)
    r = cli("verify", "--socket", str(daemon.socket), "--repair", "--json")
    report = json.loads(r.stdout)
    assert r.returncode == 1 and report["moved_aside"] == [], r.stdout + r.stderr
    assert [x["path"] for x in report["not_moved"]] == [str(hashed)], report
    assert "stop the daemon and run verify --repair again" in report["not_moved"][0]["reason"]
    r = cli("verify", "--socket", str(daemon.socket), "--repair")
    assert f"BAD {hashed}: " in r.stdout and "(not moved: the daemon moves files by key" in \
        " ".join(r.stdout.split()), r.stdout
    assert hashed.exists()


def test_verify_counts_a_file_whose_header_is_damaged(short_dir: Path) -> None:
    model_dir = short_dir / "root" / "sessions" / "m"
    model_dir.mkdir(parents=True)
    (model_dir / "x.safetensors").write_bytes(b"garbage")
    r = cli("verify", "--root", str(short_dir / "root"), "--json")
    report = json.loads(r.stdout)
    assert r.returncode == 1 and report["checked"] == 1 and len(report["bad"]) == 1, r.stdout


def test_verify_says_what_a_directory_or_symlink_at_an_entrys_place_is(short_dir: Path) -> None:
    """Before: "[Errno 21] Is a directory: 14" (a descriptor's number) and
    "Too many levels of symbolic links" for one link."""
    model_dir = short_dir / "root" / "sessions" / "m"
    (model_dir / "d.safetensors").mkdir(parents=True)
    (model_dir / "s.safetensors").symlink_to(short_dir / "elsewhere.safetensors")
    r = cli("verify", "--root", str(short_dir / "root"), "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    why = {Path(b["path"]).name: b["reason"] for b in json.loads(r.stdout)["bad"]}
    assert why == {"d.safetensors": "Is a directory",
                   "s.safetensors": "it is a symlink (never followed: give the file it "
                                    "points to)"}


def test_verify_names_a_model_directory_that_is_a_symlink(
        client: Client, daemon: RunningDaemon) -> None:
    """The daemon never follows a model's directory that is a symbolic link
    (saves fail, loads miss); verify skipped it and said "all good", with a
    damaged file behind it. A symlink that names no model is not the store's."""
    assert client.save(FP, "a", filled(0.1, 1), [1]) and client.save("other", "b",
                                                                        filled(0.2, 1), [1])
    assert client.flush(timeout=WAIT)
    model_dir = entry_path(daemon.root, "a").parent
    elsewhere = daemon.root.parent / "elsewhere"
    model_dir.rename(elsewhere)
    model_dir.symlink_to(elsewhere, target_is_directory=True)
    (model_dir.parent / "Notes").symlink_to(elsewhere, target_is_directory=True)
    # Files, and links to none, under names a model could have are anybody's
    # (notes, a backup): not the store's, not reported.
    (model_dir.parent / "backup").write_text("not a directory")
    (model_dir.parent / "m3").symlink_to(daemon.root.parent / "nowhere")
    for argv in ([], ["--json"]):
        r = cli("verify", "--socket", str(daemon.socket), *argv)
        assert r.returncode == 1, r.stdout + r.stderr
        if argv:
            report = json.loads(r.stdout)
            assert report["checked"] == 1 and report["bad"] == [], report
            assert [x["path"] for x in report["could_not_read"]] == [str(model_dir)], report
        else:
            said = " ".join(r.stdout.split())
            assert f"NOT CHECKED {model_dir}: a symbolic link, which the daemon never " \
                   "follows" in said and "1 not checked" in said, said


def test_verify_while_the_daemon_deletes_reports_no_bad_file(
    client: Client, daemon: RunningDaemon
) -> None:
    """Files deleted between verify's listing and its reading were reported BAD
    ("No such file") or ended it with a traceback. Racy by nature: whatever
    the timing, nothing may be reported bad."""
    for i in range(200):
        assert client.save("gone", str(i), filled(0.05, 1), [1])
    assert client.flush(timeout=WAIT)
    rm = subprocess.Popen([sys.executable, "-m", "kvkeeper.cli", "rm", "--socket",
                           str(daemon.socket), "--model", "gone"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        r = cli("verify", "--socket", str(daemon.socket), "--json")
    finally:
        assert rm.wait(WAIT) == 0
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert json.loads(r.stdout)["bad"] == []


def test_verify_repair_that_cannot_run_still_reports_the_check(
    client: Client, daemon: RunningDaemon, short_dir: Path
) -> None:
    """verify --root R --repair, with another socket than the daemon's that
    serves R: the repair cannot take the root, and its error used to be the
    only output (no BAD lines, no JSON at all)."""
    assert client.save(FP, "bad", filled(0.5, 3), [3]) and client.flush(timeout=WAIT)
    bad = entry_path(daemon.root, "bad")
    os.truncate(bad, bad.stat().st_size - 10)
    elsewhere = str(short_dir / "none.sock")
    r = cli("verify", "--socket", elsewhere, "--root", str(daemon.root), "--repair", "--json")
    assert r.returncode == 2 and "another kvkeeper daemon" in r.stderr, (r.stdout, r.stderr)
    report = json.loads(r.stdout)
    assert [b["path"] for b in report["bad"]] == [str(bad)] and report["moved_aside"] == []
    assert "another kvkeeper daemon" in report["repair_error"]
    assert report["not_moved"] == [{"path": str(bad), "reason": "another daemon serves this root"}]
    r = cli("verify", "--socket", elsewhere, "--root", str(daemon.root), "--repair")
    said = " ".join(r.stdout.split())
    assert r.returncode == 2 and f"BAD {bad}" in said, r.stdout
    # Which of them were not moved, and how to reach the daemon that can
    # (before: neither said).
    assert "(not moved: another daemon serves this root)" in said, r.stdout
    assert f"--socket={daemon.socket}" in r.stderr, r.stderr
    assert bad.exists()  # left to the daemon that holds the root


def _damaged_entry(root: Path, sock: Path) -> Path:
    """An entry "bad" saved through the daemon at ``sock``, then cut short."""
    with Client(sock, timeout=WAIT) as kv:
        assert kv.save(FP, "bad", filled(0.5, 3), [3]) and kv.flush(timeout=WAIT)
    bad = entry_path(root, "bad")
    os.truncate(bad, bad.stat().st_size - 10)
    return bad


def test_verify_repair_names_the_daemon_s_socket_whatever_its_root_is_called(
        short_dir: Path) -> None:
    """The socket is read from the daemon's lock file ("pid N, root R, socket
    S"): a root named "..., socket x" made the hint name "x, socket S"."""
    root, sock = short_dir / "r, socket x", short_dir / "run" / "kv.sock"
    d = start_daemon(root, sock)
    try:
        _damaged_entry(root, sock)
        r = cli("verify", "--socket", str(short_dir / "none.sock"), "--root", str(root),
                "--repair")
        assert r.returncode == 2 and r.stderr.rstrip().endswith(f"--socket={sock}"), r.stderr
    finally:
        d.stop()


def test_verify_repair_through_another_daemon_gives_a_command_that_runs_as_pasted(
        short_dir: Path) -> None:
    """The hint naming the daemon to repair through, pasted back into a shell
    where the root was given: it said ``--root -r`` for a root named "-r",
    which argparse took for an option."""
    from .test_cli_checks import cli as cli_in

    root, sock = short_dir / "-r", short_dir / "run" / "kv.sock"
    d = start_daemon(root, sock)
    try:
        bad = _damaged_entry(root, sock)
        r = cli_in("verify", "--socket", str(short_dir / "none.sock"), "--root=-r", "--repair",
                   cwd=short_dir)
        assert r.returncode == 2 and "repair through it: " in r.stderr, r.stderr
        words = shlex.split(r.stderr.rstrip().rsplit("repair through it: ", 1)[1])
        assert words[:3] == ["kvkeeper", "verify", "--repair"], words
        r = cli_in(*words[1:], cwd=short_dir)
        assert r.returncode == 1 and f"BAD {bad.relative_to(short_dir)}" in r.stdout \
            and "moved aside" in r.stdout, (r.stdout, r.stderr)
        assert not bad.exists()
    finally:
        d.stop()


@pytest.mark.parametrize("encoding", ["utf-8", "ascii"])
def test_verify_s_repair_command_names_a_root_of_any_name_when_pasted(
        short_dir: Path, encoding: str) -> None:
    """The --repair command verify suggests, for a root whose name holds a
    tab, an ESC, a byte that is no UTF-8, a no-break space, a line
    separator and an accent: pasted into bash in the C locale it repairs
    that root, whatever the encoding of verify's output. It was quoted and
    then escaped for the terminal, the tab shown as the two characters \\t:
    pasted back, it named another root; the first $'...' form named the
    no-break space as one byte, and the line separator as \\U2028, which
    bash reads only in a UTF-8 locale (a review)."""
    from .test_cli_checks import cli as cli_in

    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    d = start_daemon(root, sock)
    try:
        _damaged_entry(root, sock)
    finally:
        d.stop()
    odd = short_dir / (os.fsdecode(b"r\tx\x1by\xff'z") + "\u00a0\u2028\u00e9")
    root.rename(odd)
    r = cli_in("verify", "--root", str(odd), env={"PYTHONIOENCODING": encoding})
    said = " ".join(r.stdout.split())
    assert r.returncode == 1 and "\x1b" not in r.stdout and said.isprintable(), r.stdout
    hint = said.split(" (", 1)[1].split(" moves the bad ones aside")[0]
    assert hint.startswith("kvkeeper verify --repair --root=$'"), hint
    run = [sys.executable, "-m", "kvkeeper.cli"]
    pasted = subprocess.run(
        ["bash", "-c", shlex.join(run) + hint.removeprefix("kvkeeper")],
        capture_output=True, text=True, errors="backslashreplace", timeout=WAIT,
        env={k: v for k, v in os.environ.items()
             if not k.startswith(("KVKEEPER_", "LC_", "LANG"))}
        | {"PYTHONPATH": str(Path(__file__).resolve().parents[1]), "LC_ALL": "C",
           "XDG_CONFIG_HOME": "/nonexistent-kvkeeper-test-config"})
    assert pasted.returncode == 1 and "moved aside" in pasted.stdout, \
        (pasted.stdout, pasted.stderr)
    assert not list((odd / "sessions").rglob("*.safetensors"))
    assert list((odd / "quarantine").rglob("*")), "the bad file was not moved aside"


def test_verify_repair_asked_of_a_stopped_daemon_says_it_did_not_answer(
        short_dir: Path) -> None:
    """The daemon at the socket given is the root's, stopped: the hint named
    that very socket to repair through, the command that had just failed."""
    from .conftest import serve_process, stop_process

    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock)
    try:
        _damaged_entry(root, sock)
        proc.send_signal(signal.SIGSTOP)
        r = cli("verify", "--socket", str(sock), "--root", str(root), "--repair")
        assert r.returncode == 2 and f"did not answer at {sock}" in r.stderr, r.stderr
        assert "repair through it" not in r.stderr, r.stderr
    finally:
        proc.send_signal(signal.SIGCONT)
        assert stop_process(proc) == 0


def test_verify_repair_that_fails_part_way_reports_what_it_moved(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The second of two moves fails (a rename error, made here by failing
    the process's second os.rename): the report listed neither as moved
    although the first went, and the error ended in a traceback. It is now
    listed under not_moved, as a move the daemon refuses is."""
    from kvkeeper import cli as kvcli

    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock")
    with Client(rd.socket, timeout=WAIT) as kv:
        for name in ("x", "y"):
            assert kv.save(FP, name, filled(0.5, 1), [1])
        assert kv.flush(timeout=WAIT)
    rd.stop()
    for name in ("x", "y"):
        path = entry_path(short_dir / "root", name)
        os.truncate(path, path.stat().st_size - 10)
    real, calls = os.rename, [0]

    def rename(src: object, dst: object, **kw: object) -> None:
        calls[0] += 1
        if calls[0] == 2:
            raise PermissionError(13, "Permission denied", str(src))
        real(src, dst, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "rename", rename)
    status = kvcli.main(["verify", "--root", str(short_dir / "root"), "--socket",
                         str(short_dir / "run" / "kv.sock"), "--repair", "--json"])
    out, errtext = capfd.readouterr()
    assert status == 1 and "Traceback" not in errtext, errtext
    report = json.loads(out)
    assert len(report["bad"]) == 2 and len(report["moved_aside"]) == 1, report
    moved = Path(report["moved_aside"][0])
    [left] = report["not_moved"]
    assert left["reason"] == "Permission denied" and "repair_error" not in report, report
    assert not moved.exists() and Path(left["path"]).exists()
    assert {moved, Path(left["path"])} == {Path(b["path"]) for b in report["bad"]}
    assert len(list((short_dir / "root" / "quarantine").iterdir())) == 1
    # main() run in-process leaves the caller's logging on: it turned every
    # warning off for the rest of the process (and of this test run).
    # (No caplog.at_level: it lifts logging.disable for its block.)
    logging.getLogger("kvkeeper.client").warning("event=still_logged")
    assert "event=still_logged" in caplog.text


def test_verify_repair_through_a_draining_daemon_reports_each_file(short_dir: Path) -> None:
    """A daemon that drains refuses to move a bad file aside: the report says
    so for the file (ab424d9 made that refusal a DaemonShuttingDown, which
    ended the repair with exit 3 and no word of the file)."""
    from kvkeeper.daemon.faults import ENV

    from .conftest import drain_past_the_notice, serve_process, stop_process

    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    rd = start_daemon(root, sock)
    with Client(sock, timeout=WAIT) as kv:
        assert kv.save(FP, "victim", filled(0.5, 1), [1]) and kv.flush(timeout=WAIT)
    rd.stop()
    victim = entry_path(root, "victim")
    os.truncate(victim, victim.stat().st_size - 10)
    # 0.25 s per MiB: the drain writes the 32 MiB save for about 8 s.
    proc = serve_process(root, sock, "--drain-timeout", "60", env={ENV: "write_delay=0.25"})
    try:
        with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
            assert kv.save(FP, "big", filled(32, 1), [1])
            drain_past_the_notice(kv, proc, received=1)
            r = cli("verify", "--root", str(root), "--socket", str(sock), "--repair", "--json")
            assert proc.poll() is None  # the repair asked the draining daemon
        assert r.returncode == 1, r.stdout + r.stderr
        report = json.loads(r.stdout)
        assert report["not_moved"] == [{"path": str(victim),
                                        "reason": "the daemon is shutting down"}], report
        assert "repair_error" not in report and victim.exists()
    finally:
        stop_process(proc, signal.SIGKILL)


def test_a_root_held_by_verify_repair_is_not_said_to_be_a_daemon_s(short_dir: Path) -> None:
    """verify --repair with no daemon takes the root's lock while it moves
    files: a second repair, or serve, was told "another kvkeeper daemon is
    running (kvkeeper verify --repair, pid N)"."""
    from kvkeeper.daemon.app import LOCK_NAME, lock_holder

    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    rd = start_daemon(root, sock)
    bad = _damaged_entry(root, sock)
    assert rd.stop() == 0
    for i in range(300):  # each moved with its fsyncs: time to catch it holding the lock
        entry_path(root, f"bad{i}").write_bytes(b"not a cache")
    first = subprocess.Popen([sys.executable, "-m", "kvkeeper.cli", "verify", "--root", str(root),
                              "--socket", str(short_dir / "none.sock"), "--repair"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + WAIT
        while not (lock_holder(root / LOCK_NAME) or "").startswith("kvkeeper verify"):
            assert first.poll() is None and time.monotonic() < deadline, "never held the lock"
            time.sleep(0.001)
        first.send_signal(signal.SIGSTOP)
        want = f"kvkeeper verify --repair is running (pid {first.pid}); lock file {root / LOCK_NAME}"
        r = cli("verify", "--root", str(root), "--socket", str(short_dir / "none.sock"), "--repair")
        assert r.returncode == 2 and want in r.stderr and "daemon" not in r.stderr, r.stderr
        r = cli("serve", "--root", str(root), "--socket", str(short_dir / "other.sock"))
        assert r.returncode != 0 and want in r.stderr and "daemon is" not in r.stderr, r.stderr
    finally:
        first.send_signal(signal.SIGCONT)
        assert first.wait(WAIT) == 1
    assert not bad.exists()


def test_verify_repair_without_a_daemon(short_dir: Path) -> None:
    """A bad entry is moved aside. Files under names the daemon does not give
    are not its own (the store lists them as foreign): they were judged bad
    and moved to quarantine/ too, whose files the disk budget deletes first."""
    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock")
    with Client(rd.socket, timeout=WAIT) as kv:
        assert kv.save(FP, "x", filled(0.5, 1), [1]) and kv.flush(timeout=WAIT)
    rd.stop()
    path = entry_path(short_dir / "root", "x")
    os.truncate(path, path.stat().st_size - 10)
    theirs = [path.with_name("Notes.safetensors"), path.parent.parent / "Other" / "q.safetensors"]
    theirs[1].parent.mkdir()
    for p in theirs:
        p.write_bytes(path.read_bytes())  # truncated: bad, were it an entry
    r = cli("verify", "--root", str(short_dir / "root"), "--socket",
            str(short_dir / "run" / "kv.sock"), "--repair", "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    assert json.loads(r.stdout)["moved_aside"] == [str(path)]
    assert not path.exists() and len(list((short_dir / "root" / "quarantine").iterdir())) == 1
    assert all(p.exists() for p in theirs)


def test_import_refuses_a_second_file_for_the_same_key(
    client: Client, daemon: RunningDaemon, short_dir: Path
) -> None:
    """a/x.safetensors and b/x.safetensors (mlx-lm files carry no id) were both
    'imported' as x, exit 0: the second replaced the first."""
    from mlx_lm.models.cache import save_prompt_cache

    for sub, v in (("a", 1), ("b", 2)):
        (short_dir / "imp" / sub).mkdir(parents=True)
        save_prompt_cache(str(short_dir / "imp" / sub / "x.safetensors"), filled(0.1, v))
    r = cli("import", "--socket", str(daemon.socket), "--model", "mimp",
            str(short_dir / "imp"), "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert [i["path"] for i in report["imported"]] == [str(short_dir / "imp" / "a" / "x.safetensors")]
    assert [f["path"] for f in report["failed"]] == [str(short_dir / "imp" / "b" / "x.safetensors")]
    assert "imported from" in report["failed"][0]["reason"]
    got = client.load("mimp", "x")
    assert got is not None and mx.all(got.cache[0].state[0] == 1).item()


def test_import_reports_files_it_cannot_store_and_goes_on(
    client: Client, daemon: RunningDaemon, short_dir: Path
) -> None:
    """A file named just ".safetensors" (no cache id), one recording a model
    name over 1024 bytes, and one with 9 MiB of metadata, among sound files:
    the first two ended the run as a usage error (exit 2, nothing reported,
    the files after them never tried), the third with a traceback."""
    from mlx_lm.models.cache import save_prompt_cache

    src = short_dir / "odd"
    src.mkdir()
    save_prompt_cache(str(src / "-x.safetensors"), filled(0.1, 1))
    save_prompt_cache(str(src / ".safetensors"), filled(0.1, 2))
    save_prompt_cache(str(src / "b-long-model.safetensors"), filled(0.1, 3),
                      metadata={"kvkeeper_model": "M" * 2000})
    save_prompt_cache(str(src / "c-big-meta.safetensors"), filled(0.1, 4),
                      metadata={"note": "x" * (9 << 20)})
    save_prompt_cache(str(src / "z.safetensors"), filled(0.1, 5))
    r = cli("import", "--socket", str(daemon.socket), "--model", "modd", str(src), "--json")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert sorted(i["cache_id"] for i in report["imported"]) == ["-x", "z"], report
    why = {Path(f["path"]).name: f["reason"] for f in report["failed"]}
    assert "its name gives no cache id (cache id is empty): import it alone, with --id" \
        in why.pop(".safetensors")
    assert "the file records model 'MMM" in why.pop("b-long-model.safetensors")
    assert "metadata is" in why.pop("c-big-meta.safetensors") and not why
    assert sorted(e.cache_id for e in client.entries("modd")) == ["-x", "z"]
    # Without --model: the model the file records, or the name, is the one
    # refused (before: the model was blamed for the name of a file that
    # records one).
    shutil.copyfile(ROOT / "gezel-schema3" / "fp-demo" / "kv.safetensors",
                    short_dir / ".safetensors")
    for path, says in ((src / "b-long-model.safetensors",
                        "the model the file records cannot be stored: model is 2000 bytes; "
                        "the limit is 1024"),
                       (short_dir / ".safetensors",
                        "its name gives no cache id (cache id is empty): import it alone, "
                        "with --id")):
        r = cli("import", "--socket", str(daemon.socket), str(path), "--json")
        assert r.returncode == 1, r.stdout + r.stderr
        assert json.loads(r.stdout)["failed"][0]["reason"] == says


def _import_six(short_dir: Path, mib: float, model: str, **daemon: Any) -> tuple[
        RunningDaemon, subprocess.CompletedProcess[str]]:
    """Six mlx-lm files of ``mib`` MiB each (c1 to c6) imported with --json as
    ``model`` into a daemon of their own (settings ``daemon``), left running."""
    from mlx_lm.models.cache import save_prompt_cache

    (short_dir / "six").mkdir()
    for v in range(1, 7):
        save_prompt_cache(str(short_dir / "six" / f"c{v}.safetensors"), filled(mib, v))
    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock", **daemon)
    try:
        return rd, cli("import", "--socket", str(rd.socket), "--model", model,
                       str(short_dir / "six"), "--json")
    except BaseException:
        rd.stop()
        raise


def test_import_composes_an_id_taken_from_a_decomposed_file_name(
    client: Client, daemon: RunningDaemon, short_dir: Path
) -> None:
    """HFS+ and SMB shares give names decomposed (NFD): "cafe\u0301" was
    imported as that id, and the server's load of "caf\u00e9" (NFC, as
    text usually comes) missed, while ls showed the same-looking id."""
    from mlx_lm.models.cache import save_prompt_cache

    save_prompt_cache(str(short_dir / "cafe\u0301.safetensors"), filled(0.1, 3))
    r = cli("import", "--socket", str(daemon.socket), "--model", "mn",
            str(short_dir / "cafe\u0301.safetensors"), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert [i["cache_id"] for i in json.loads(r.stdout)["imported"]] == ["caf\u00e9"]
    got = client.load("mn", "caf\u00e9")
    assert got is not None and mx.all(got.cache[0].state[0] == 3).item()
    # Both forms in one directory: the file named "caf\u00e9" is the one
    # imported (the decomposed name sorts first, and was).
    both = short_dir / "both"
    both.mkdir()
    for name, v in (("caf\u00e9", 4), ("cafe\u0301", 5)):
        save_prompt_cache(str(both / f"{name}.safetensors"), filled(0.1, v))
    r = cli("import", "--socket", str(daemon.socket), "--model", "mn2", str(both), "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert [Path(i["path"]).name for i in report["imported"]] == ["caf\u00e9.safetensors"]
    assert [Path(f["path"]).name for f in report["failed"]] == ["cafe\u0301.safetensors"]
    got = client.load("mn2", "caf\u00e9")
    assert got is not None and mx.all(got.cache[0].state[0] == 4).item()
    # Given as PATH arguments in that order (a shell's glob gives it): the same.
    r = cli("import", "--socket", str(daemon.socket), "--model", "mn3", "--json",
            str(both / "cafe\u0301.safetensors"), str(both / "caf\u00e9.safetensors"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert [Path(i["path"]).name for i in json.loads(r.stdout)["imported"]] == \
        ["caf\u00e9.safetensors"]
    # Other files keep the order of their paths, directory by directory
    # (x/ before x.old/: the first version of this sorted whole paths as text).
    for sub, v in (("x", 6), ("x.old", 7)):
        (short_dir / "dirs" / sub).mkdir(parents=True)
        save_prompt_cache(str(short_dir / "dirs" / sub / "foo.safetensors"), filled(0.1, v))
    r = cli("import", "--socket", str(daemon.socket), "--model", "mn4", "--json",
            str(short_dir / "dirs"))
    assert [Path(i["path"]).parent.name for i in json.loads(r.stdout)["imported"]] == ["x"]


def test_import_reports_entries_the_disk_budget_evicted_during_the_run(
        short_dir: Path) -> None:
    """Six 0.5 MiB files into a store of 2 MiB: import said "imported" of all
    six, exit 0, while the budget had evicted the first ones for the later."""
    rd, r = _import_six(short_dir, 0.5, "mv", max_disk_bytes=2 * MiB)
    try:
        assert r.returncode == 1, r.stdout + r.stderr
        report = json.loads(r.stdout)
        with Client(rd.socket, timeout=WAIT) as kv:
            stored = sorted(e.cache_id for e in kv.entries("mv"))
        assert 0 < len(stored) < 6
        assert sorted(i["cache_id"] for i in report["imported"]) == stored
        evicted = {Path(f["path"]).name.removesuffix(".safetensors"): f["reason"]
                   for f in report["failed"]}
        assert sorted(evicted) == sorted(set(f"c{v}" for v in range(1, 7)) - set(stored))
        assert all("evicted by the disk budget" in why for why in evicted.values()), evicted
    finally:
        assert rd.stop() == 0


def test_import_of_more_than_the_daemons_pending_budget(short_dir: Path) -> None:
    """Six 8 MiB files into a daemon with a 12 MiB pending budget: every file
    was handed off at once, the daemon refused most as busy, and import said
    only 'could not write every imported entry' (no report, even with --json)."""
    rd, r = _import_six(short_dir, 8, "mb", max_pending_bytes=12 * MiB)
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        assert len(json.loads(r.stdout)["imported"]) == 6
        with Client(rd.socket, timeout=WAIT) as kv:
            assert sorted(e.cache_id for e in kv.entries("mb")) == [f"c{v}" for v in range(1, 7)]
    finally:
        assert rd.stop() == 0


def test_import_reports_what_it_imported_when_the_daemon_dies_part_way(short_dir: Path) -> None:
    """The daemon killed while import waits for a file's flush: import ended
    with 'the daemon went away' (exit 3) and no report of the files it had
    already imported, even with --json."""
    from mlx_lm.models.cache import save_prompt_cache

    from kvkeeper.daemon.faults import ENV

    from .conftest import serve_process

    (short_dir / "big").mkdir()
    for v in range(1, 5):
        save_prompt_cache(str(short_dir / "big" / f"c{v}.safetensors"), filled(8, v))
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock, env={ENV: "write_delay=0.05"})  # 0.4 s a file
    try:
        imp = subprocess.Popen([sys.executable, "-m", "kvkeeper.cli", "import", "--socket",
                                str(sock), "--model", "mb", str(short_dir / "big"), "--json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # c2's write begun: c1's flush was answered, and c2's never will be.
        deadline = time.monotonic() + WAIT
        while not any("c2" in p.name for p in tmp_files(root)):
            assert time.monotonic() < deadline and imp.poll() is None, "c2 never begun"
            time.sleep(0.01)
        proc.kill()
        stdout, stderr = imp.communicate(timeout=WAIT)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert imp.returncode == 3, stderr
    report = json.loads(stdout)
    assert [Path(i["path"]).name for i in report["imported"]] == ["c1.safetensors"]
    assert [Path(f["path"]).name for f in report["failed"]] == ["c2.safetensors"]
    assert "went away" in stderr


def _import_here(*argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, Any, str]:
    """``kvkeeper import --json`` run in this process: status, report, stderr."""
    from kvkeeper.cli import main

    code = main(["import", *argv, "--json"])
    out, err = capsys.readouterr()
    return code, json.loads(out), err


def test_import_stops_at_a_file_the_daemon_is_slow_to_write_and_reports_it(
        short_dir: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A file the daemon did not say it wrote within import's wait (300 s; 0.5
    here, the disk made slow) was called the daemon going away: exit 3. It
    is reported as not known to be written, and the run stops there, exit 1:
    going on, the next file's flush answered for it too, and a failure of
    its write was reported as the next file's (a review)."""
    from mlx_lm.models.cache import save_prompt_cache

    from kvkeeper.daemon.faults import ENV
    from kvkeeper.ops import transfer

    from .conftest import serve_process

    monkeypatch.setattr(transfer, "FLUSH_TIMEOUT", 0.5)
    (short_dir / "two").mkdir()
    save_prompt_cache(str(short_dir / "two" / "c1.safetensors"), filled(4, 1))
    save_prompt_cache(str(short_dir / "two" / "c2.safetensors"), filled(0.1, 2))
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock, env={ENV: "write_delay=0.5"})  # 2 s for c1
    try:
        code, report, err = _import_here("--socket", str(sock), "--model", "ms",
                                         str(short_dir / "two"), capsys=capsys)
        assert code == 1, err
        assert report["imported"] == []
        [failed] = report["failed"]
        assert failed["path"].endswith("c1.safetensors")
        assert "not known to be written" in failed["reason"] \
            and "did not answer within" in failed["reason"], failed
        assert "went away" not in err and "the files after it were not imported" in err, err
        with Client(sock, timeout=WAIT) as kv:  # the daemon writes it all the same
            wait_for(lambda: [e.cache_id for e in kv.entries("ms")] == ["c1"], "c1 written")
    finally:
        assert stop_process(proc) == 0


def test_import_reports_what_the_daemon_refused_to_list(
        short_dir: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The daemon up and refusing import's listing of a model (busy: more
    requests waiting than it takes, none here): the run ended as "the daemon
    refused", with no report, not even with --json."""
    from mlx_lm.models.cache import save_prompt_cache

    from kvkeeper.daemon import server

    save_prompt_cache(str(short_dir / "c1.safetensors"), filled(0.1, 1))
    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock")
    try:
        monkeypatch.setattr(server, "MAX_WAITING", 0)
        code, report, err = _import_here("--socket", str(rd.socket), "--model", "mr",
                                         str(short_dir / "c1.safetensors"), capsys=capsys)
        assert code == 1, err
        assert report["imported"] == []
        [failed] = report["failed"]
        assert "did not list the model's entries" in failed["reason"] \
            and "busy" in failed["reason"], failed
    finally:
        monkeypatch.undo()
        assert rd.stop() == 0


def test_import_exits_3_when_the_daemon_dies_between_two_files(short_dir: Path) -> None:
    """The daemon gone after one file's flush, before the next save: every
    later file was 'not handed to the daemon', exit 1, and nothing said the
    daemon had gone. The import is stopped while the daemon dies, so the
    next file finds it gone."""
    from mlx_lm.models.cache import save_prompt_cache

    from kvkeeper.daemon.faults import ENV

    from .conftest import serve_process

    (short_dir / "small").mkdir()
    for v in range(1, 5):
        save_prompt_cache(str(short_dir / "small" / f"c{v}.safetensors"), filled(1, v))
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    # 50 ms a file: the import cannot run past c3 before it is stopped.
    proc = serve_process(root, sock, env={ENV: "write_delay=0.05"})
    try:
        imp = subprocess.Popen([sys.executable, "-m", "kvkeeper.cli", "import", "--socket",
                                str(sock), "--model", "mb", str(short_dir / "small"), "--json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        written = root / "sessions" / "mb" / "c2.safetensors"
        deadline = time.monotonic() + WAIT
        while not written.exists():
            assert time.monotonic() < deadline and imp.poll() is None, "c2 never written"
            time.sleep(0.005)
        imp.send_signal(signal.SIGSTOP)
        proc.kill()
        proc.wait(WAIT)
        time.sleep(0.2)
        imp.send_signal(signal.SIGCONT)
        stdout, stderr = imp.communicate(timeout=WAIT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert imp.returncode == 3, (stdout, stderr)
    report = json.loads(stdout)
    imported = [Path(i["path"]).name for i in report["imported"]]
    failed = [Path(f["path"]).name for f in report["failed"]]
    assert imported[:1] == ["c1.safetensors"] and len(failed) == 1, report
    reason = report["failed"][0]["reason"]
    assert "went away" in stderr, stderr
    assert "went away" in reason or "not known to be written" in reason, reason


@pytest.mark.skipif(MLX_LM_OLD_API, reason="mlx-lm 0.31 has no DeepSeek V4.1")
def test_deepseek_v41_is_neither_exported_nor_imported_from_mlx_lm_files(
        client: Client, daemon: RunningDaemon, short_dir: Path) -> None:
    """mlx-lm's loader cannot rebuild DeepSeek V4.1's LayerCache, and its
    writer leaves out the window size: export refuses it and import of
    mlx-lm's own file says why (before: "... is not a cache class")."""
    from mlx_lm.models.cache import save_prompt_cache

    sock = str(daemon.socket)
    model = tiny_deepseek_v41()
    cache = model.make_cache()
    prefill(model, prompt(20), cache)
    assert client.save("ds", "conv", cache, prompt(20)) and client.flush(timeout=WAIT)
    r = cli("export", "--socket", sock, "ds", "conv", str(short_dir / "out.safetensors"))
    assert r.returncode == 1 and "mlx-lm's loader cannot rebuild" in r.stderr, r.stderr
    assert not (short_dir / "out.safetensors").exists()
    theirs = short_dir / "theirs.safetensors"
    save_prompt_cache(str(theirs), cache)
    r = cli("import", "--socket", sock, "--model", "ds", str(theirs))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "do not record its window size" in r.stdout + r.stderr, r.stdout + r.stderr


def test_export_refuses_what_mlx_lm_files_would_give_back_otherwise(
        client: Client, daemon: RunningDaemon, short_dir: Path) -> None:
    """mlx-lm's ConcatenateKVCache trims only its offset, and its state leaves
    the offset out: mlx-lm's own file of a trimmed one loads untrimmed (the
    positions of every later token wrong, no error). So does mlx-lm 0.31's
    file of a ChunkedKVCache trimmed at the front. export refuses them; the
    same layer untrimmed exports."""
    from mlx_lm.models.cache import ChunkedKVCache, ConcatenateKVCache

    sock = str(daemon.socket)
    rows = mx.random.normal((1, 2, 13, 16))
    c = ConcatenateKVCache()
    c.update_and_fetch(rows, rows)
    c.trim(3)
    assert client.save("cc", "trimmed", [c], list(range(10))) and client.flush(timeout=WAIT)
    out = short_dir / "out.safetensors"
    r = cli("export", "--socket", sock, "cc", "trimmed", str(out))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "cannot record the offset of a trimmed ConcatenateKVCache (10 of 13 rows)" in r.stderr
    assert not out.exists()
    if MLX_LM_OLD_API:
        ch = ChunkedKVCache(chunk_size=16)
        ch.update_and_fetch(rows, rows)
        ch.maybe_trim_front()  # mlx-lm 0.31 trims by its buffer: 256 rows
        assert ch.start_position > 0
        assert client.save("cc", "chunked", [ch], list(range(13))) and client.flush(timeout=WAIT)
        r = cli("export", "--socket", sock, "cc", "chunked", str(out))
        assert r.returncode == 1 and "ChunkedKVCache trimmed at the front" in r.stderr, r.stderr
    whole = ConcatenateKVCache()
    whole.update_and_fetch(rows, rows)
    assert client.save("cc", "whole", [whole], list(range(13))) and client.flush(timeout=WAIT)
    r = cli("export", "--socket", sock, "cc", "whole", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert mx.array_equal(mx.load(str(out))["0.0"], rows).item()


def test_import_legacy_files_and_export_for_mlx_lm(client: Client, daemon: RunningDaemon,
                                                    short_dir: Path) -> None:
    sock = str(daemon.socket)
    # mlx-lm files record no model: --model is required.
    r = cli("import", "--socket", sock, str(ROOT / "mlx-lm" / "kv.safetensors"))
    assert r.returncode == 1 and "give --model" in r.stdout
    r = cli("import", "--socket", sock, "--model", "lm", str(ROOT / "mlx-lm"), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(json.loads(r.stdout)["imported"]) == 6
    r = cli("import", "--socket", sock, str(ROOT / "gezel-schema3"))
    assert r.returncode == 0, r.stdout + r.stderr
    # Files in the layout mlx-lm 0.31 and earlier wrote (mlx-lm 0.32 cannot read them).
    # Its ChunkedKVCache, trimmed at the front, does not record where its tokens end.
    r = cli("import", "--socket", sock, "--model", "lm031", str(ROOT / "mlx-lm-0.31"), "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert len(out["imported"]) == 5
    assert [Path(f["path"]).name for f in out["failed"]] == ["chunked.safetensors"]
    assert "front was trimmed (start_position 240)" in out["failed"][0]["reason"]
    old = client.load("lm031", "rotating")
    assert old is not None
    assert ([describe(c) for c in old.cache]
            == MANIFEST["mlx-lm-0.31/rotating.safetensors"]["layers"])
    names = {(e.model, e.cache_id) for e in client.entries()}
    assert ("fp-demo", "kv") in names and ("lm", "rotating") in names
    got = client.load("fp-demo", "kv")
    want = MANIFEST["gezel-schema3/fp-demo/kv.safetensors"]
    assert got is not None and got.token_ids == want["token_ids"]
    # The writer's bookkeeping is restored as such, not copied into the
    # metadata (before: every token id twice, the classes, the schema).
    assert got.metadata == {"saved_at": "1796031182.5660653"}
    assert kvkeeper.read_cache_file(
        ROOT / "gezel-schema3" / "fp-demo" / "kv.safetensors").metadata == got.metadata

    # Export a real model's cache; mlx-lm's own loader opens it and the model
    # continues bit-identically.
    model = tiny_llama(seed=3)
    tokens = prompt(40)
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache)
    user = {"user": "alice", "turn.no": "3"}  # a dot: mlx-lm's loader would nest it
    assert client.save("tiny", "conv", cache, tokens, metadata=user)
    assert client.flush(timeout=WAIT)
    out = short_dir / "exported.safetensors"
    r = cli("export", "--socket", sock, "tiny", "conv", str(out))
    assert r.returncode == 0, r.stderr
    loaded, meta = load_prompt_cache(str(out), return_metadata=True)
    assert json.loads(meta["token_ids"]) == tokens and meta["kvkeeper_model"] == "tiny"
    assert json.loads(meta["kvkeeper_metadata"]) == user
    a = model(mx.array([[5]]), cache=loaded)[0, -1]
    b = model(mx.array([[5]]), cache=cache)[0, -1]
    mx.eval(a, b)
    np.testing.assert_array_equal(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)))
    # It records its key: opened as another's, it is refused (it was not).
    assert kvkeeper.read_cache_file(out, model="tiny", cache_id="conv").cache_id == "conv"
    for other in ({"cache_id": "other"}, {"model": "other"}):
        with pytest.raises(kvkeeper.CacheFileError, match="not 'other'"):
            kvkeeper.read_cache_file(out, **other)
    # And back: the exported file imports like any mlx-lm file.
    r = cli("import", "--socket", sock, "--model", "tiny", "--id", "back", str(out))
    assert r.returncode == 0, r.stdout
    back = client.load("tiny", "back")
    assert back is not None and back.token_ids == tokens
    # Its metadata is the exported entry's, without the export's bookkeeping
    # (before: the user's was lost, and the model, id and every token id
    # were copied into it).
    assert back.metadata == user
    # With no --model or --id, the key it was exported from, and its tokens.
    client.delete("tiny", "conv")
    r = cli("import", "--socket", sock, str(out))
    assert r.returncode == 0, r.stdout
    again = client.load("tiny", "conv")
    assert again is not None and again.token_ids == tokens
    # mlx-vlm classes cannot be rebuilt by mlx-lm's loader: a clear refusal.
    r = cli("export", "--socket", sock, "fp-demo", "kv", str(short_dir / "vlm.safetensors"))
    assert r.returncode == 1 and "only caches of mlx_lm.models.cache" in r.stderr
    r = cli("export", "--socket", sock, "tiny", "nope", str(short_dir / "n.safetensors"))
    assert r.returncode == 1 and "no entry" in r.stderr


def _run_service_command(cmd: list[str], short_dir: Path,
                         env: dict[str, str] | None = None) -> None:
    """Run the exact command line a service file holds, from / as the
    service does; it must serve and stop."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            cwd="/", env=env)
    try:
        sock = short_dir / "svc" / "kv.sock"
        deadline = time.monotonic() + WAIT
        while not (sock.exists() and ping(sock)):
            assert proc.poll() is None, f"service command exited {proc.returncode}"
            assert time.monotonic() < deadline, "service command did not serve"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT) == 0


def test_launchd_plist(short_dir: Path) -> None:
    r = cli("install-service", "--print", "--platform", "macos", "--root",
            str(short_dir / "svcroot"), "--socket", str(short_dir / "svc" / "kv.sock"),
            "--drain-timeout", "30", "--max-disk-bytes", "10G")
    assert r.returncode == 0, r.stderr
    plist = plistlib.loads(r.stdout.encode())
    assert plist["Label"].count(".") >= 2 and plist["RunAtLoad"]
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    assert plist["ExitTimeOut"] >= 30
    args = plist["ProgramArguments"]
    assert os.path.isabs(args[0]) and args[1:4] == ["-m", "kvkeeper.cli", "serve"]
    assert "--max-disk-bytes" in args and plist["StandardErrorPath"].endswith(".log")
    _run_service_command(args, short_dir)


def test_a_launch_agent_that_cannot_start_is_not_started_again(short_dir: Path) -> None:
    """launchd's KeepAlive started the agent again every 10 s after any
    exit, exit 2 too (a setting refused: a typo in the config file made after
    the install), forever. The agent is now kept alive after a failure only,
    and its daemon gives exit 2 as 0, saying why; exit 1 (its socket
    removed: a new start mends it) stays 1."""
    cfg = short_dir / "kv.toml"
    cfg.write_text("")
    sock = short_dir / "svc" / "kv.sock"
    r = cli("install-service", "--print", "--platform", "macos", "--root",
            str(short_dir / "svcroot"), "--socket", str(sock), "--drain-timeout", "5",
            env={"KVKEEPER_CONFIG": str(cfg)})
    assert r.returncode == 0, r.stderr
    plist = plistlib.loads(r.stdout.encode())
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    args, env = plist["ProgramArguments"], plist["EnvironmentVariables"]
    assert "--config" in args and env["KVKEEPER_SERVICE_MANAGER"] == "launchd", (args, env)
    # As launchd runs it: its environment is the plist's, from /.
    agent = {"PATH": os.environ["PATH"], "HOME": str(short_dir), **env}
    cfg.write_text("max_disk_byte = '10G'\n")  # the typo, after the install
    for extra, said in (([], "unknown settings ['max_disk_byte']"),
                        (["--bogus"], "unrecognized arguments: --bogus")):
        done = subprocess.run([*args, *extra], capture_output=True, text=True, cwd="/",
                              env=agent, timeout=WAIT)
        assert done.returncode == 0 and said in done.stderr, done.stderr
        assert "exit status 0, not 2: launchd would start this agent again" in done.stderr
        assert "launchctl kickstart gui/" in done.stderr
        # Outside launchd, the same command line exits 2.
        done = subprocess.run([*args, *extra], capture_output=True, text=True, cwd="/",
                              env={k: v for k, v in agent.items()
                                   if k != "KVKEEPER_SERVICE_MANAGER"}, timeout=WAIT)
        assert done.returncode == 2 and "launchd" not in done.stderr, done.stderr
    cfg.write_text("")
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            cwd="/", env=agent)
    try:
        deadline = time.monotonic() + WAIT
        while not (sock.exists() and ping(sock)):
            assert proc.poll() is None, f"the agent's daemon exited {proc.returncode}"
            assert time.monotonic() < deadline, "the agent's daemon did not serve"
            time.sleep(0.05)
        sock.unlink()
        assert proc.wait(WAIT) == 1
    finally:
        proc.kill()
        proc.wait(WAIT)


def test_systemd_unit(short_dir: Path) -> None:
    r = cli("install-service", "--print", "--platform", "linux", "--root",
            str(short_dir / "svcroot"), "--socket", str(short_dir / "svc" / "kv.sock"))
    assert r.returncode == 0, r.stderr
    unit = r.stdout
    assert "[Service]" in unit and "WantedBy=default.target" in unit
    assert "TimeoutStopSec=30" in unit
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    cmd = shlex.split(exec_start.removeprefix("ExecStart="))
    assert os.path.isabs(cmd[0])
    analyze = shutil.which("systemd-analyze")
    if analyze:  # where available: systemd's own check of the unit
        f = short_dir / "kvkeeper.service"
        f.write_text(unit)
        v = subprocess.run([analyze, "verify", "--user", str(f)], capture_output=True,
                           text=True, timeout=WAIT)
        assert "kvkeeper.service" not in v.stderr or v.returncode == 0, v.stderr
    _run_service_command(cmd, short_dir)


def _python_under(place: Path) -> Path:
    """This interpreter (its venv, if it runs in one) as found under
    ``place``: a symbolic link, with the venv's pyvenv.cfg and lib beside it."""
    (place / "bin").mkdir(parents=True)
    python = place / "bin" / "python"
    python.symlink_to(os.path.realpath(sys.executable))
    if sys.prefix != sys.base_prefix:
        shutil.copy(Path(sys.prefix) / "pyvenv.cfg", place / "pyvenv.cfg")
        for lib in ("lib", "lib64"):
            if (Path(sys.prefix) / lib).exists():
                (place / lib).symlink_to(Path(sys.prefix) / lib)
    return python


@pytest.mark.parametrize("odd", ["it's", 'a "q"', "back\\slash", "a\tb", "a\x01b"])
def test_a_systemd_unit_for_an_interpreter_path_systemd_refuses(short_dir: Path,
                                                                 odd: str) -> None:
    """systemd refuses a quote or a backslash in ExecStart's executable,
    quoted or not ("Executable name contains special characters"): the unit
    was written, install-service said installed, and it never started. Such
    an interpreter is now run by /bin/sh, given to it as an argument."""
    from .test_cli_usage import _systemd_words

    python = _python_under(short_dir / odd)
    r = subprocess.run([str(python), "-m", "kvkeeper.cli", "install-service", "--print",
                        "--platform", "linux", "--root", str(short_dir / "svcroot"),
                        "--socket", str(short_dir / "svc" / "kv.sock")],
                       capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[1],
                       env={k: v for k, v in os.environ.items() if not k.startswith("KVKEEPER_")})
    assert r.returncode == 0, r.stderr
    [line] = [ln for ln in r.stdout.splitlines() if ln.startswith("ExecStart=")]
    assert not any(ord(c) < 32 for c in r.stdout.replace("\n", "")), r.stdout
    words = _systemd_words(line.removeprefix("ExecStart="))
    assert words[:4] == ["/bin/sh", "-c", 'exec "$0" "$@"', str(python)], words
    assert words[4:7] == ["-m", "kvkeeper.cli", "serve"], words
    analyze = shutil.which("systemd-analyze")
    if analyze:  # where available: systemd's own check of the unit
        f = short_dir / "kvkeeper.service"
        f.write_text(r.stdout)
        v = subprocess.run([analyze, "verify", "--user", str(f)], capture_output=True,
                           text=True, timeout=WAIT)
        assert "special characters" not in v.stderr and "fatal" not in v.stderr, v.stderr
    environment = [ln for ln in r.stdout.splitlines() if ln.startswith("Environment=")]
    env = dict(os.environ)
    if environment:
        [pinned] = _systemd_words(environment[0].removeprefix("Environment="))
        env["PYTHONPATH"] = pinned.removeprefix("PYTHONPATH=")
    _run_service_command(words, short_dir, env=env)


def test_install_and_uninstall_write_the_file(short_dir: Path) -> None:
    env = {"HOME": str(short_dir / "home"), "XDG_CONFIG_HOME": str(short_dir / "home" / ".cfg")}
    for platform, path in (("linux", short_dir / "home" / ".cfg" / "systemd" / "user"
                            / "kvkeeper.service"),
                           ("macos", short_dir / "home" / "Library" / "LaunchAgents"
                            / "io.github.kvkeeper.daemon.plist")):
        r = cli("install-service", "--platform", platform, "--no-load", env=env)
        assert r.returncode == 0 and path.exists(), r.stderr
        r = cli("uninstall-service", "--platform", platform, "--no-load", env=env)
        assert r.returncode == 0 and not path.exists(), r.stderr
    if sys.platform == "linux" and not shutil.which("systemctl"):
        r = cli("install-service", env=env)
        assert r.returncode == 1 and "loading it failed" in r.stderr


def test_a_flood_of_gc_requests_does_not_hold_up_saves(client: Client,
                                                        daemon: RunningDaemon) -> None:
    """Each gc request rescanned the whole root on the writer's turn, one
    after another: a peer sending a thousand of them held every other
    client's save up for minutes (a helper's review: 165 s with 2000
    entries). Requests that come while one is queued share it."""
    import zmq

    from kvkeeper.protocol import messages as m

    for i in range(200):
        assert client.save(FP, f"e{i}", filled(0.01, i), [i])
    assert client.flush(timeout=WAIT)
    ctx = zmq.Context()
    try:
        flood = ctx.socket(zmq.DEALER)
        flood.setsockopt(zmq.LINGER, 0)
        flood.setsockopt(zmq.RCVTIMEO, int(4 * WAIT * 1000))
        flood.connect(f"ipc://{daemon.socket}")
        for req in range(1, 501):
            flood.send(m.encode(m.Gc(v=m.PROTOCOL_VERSION, req=req)))
        time.sleep(0.2)  # the first rescans are under way
        t0 = time.monotonic()
        assert client.save(FP, "after", filled(0.01, 1), [1]) and client.flush(timeout=WAIT)
        took = time.monotonic() - t0
        answered = {m.decode_reply(flood.recv()).req for _ in range(500)}  # type: ignore[union-attr]
        assert answered == set(range(1, 501))
        assert took < 3.0, f"a save and flush took {took:.1f} s behind 500 gc requests"
    finally:
        ctx.destroy(linger=0)


def test_verify_does_not_call_a_file_it_cannot_open_bad(short_dir: Path) -> None:
    """verify counted any error opening a file as damage, and --repair moved
    the file aside (to quarantine/, which the disk budget empties first) when
    the trouble was the checking process's own: here, no permission (EACCES:
    root without the capabilities that override file modes, and a file of
    mode 0); likewise a process out of file descriptors."""
    from .faultkit import need_linux_root

    need_linux_root()
    root = short_dir / "root"
    rd = start_daemon(root, short_dir / "run" / "kv.sock")
    with Client(rd.socket, timeout=WAIT) as kv:
        for name in ("mine", "theirs"):
            assert kv.save(FP, name, filled(0.5, 2), [2])
        assert kv.flush(timeout=WAIT)
    rd.stop()
    theirs = entry_path(root, "theirs")
    theirs.chmod(0)
    drop = "-dac_override,-dac_read_search"
    r = subprocess.run(
        ["setpriv", f"--bounding-set={drop}", f"--inh-caps={drop}", sys.executable, "-m",
         "kvkeeper.cli", "verify", "--root", str(root), "--socket",
         str(short_dir / "none.sock"), "--repair", "--json"],
        capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, (r.stdout, r.stderr[-3000:])
    report = json.loads(r.stdout or "null")
    assert report is not None, r.stderr[-3000:]
    assert report["bad"] == [] and report["moved_aside"] == [], report
    assert report["could_not_read"] == [{"path": str(theirs), "reason": "Permission denied"}]
    assert report["checked"] == 1
    theirs.chmod(0o600)
    assert version_of(theirs) == 2
    quarantine = root / "quarantine"
    assert not quarantine.exists() or not any(quarantine.iterdir())
    # Without --json, people are told too.
    theirs.chmod(0)
    r = subprocess.run(
        ["setpriv", f"--bounding-set={drop}", f"--inh-caps={drop}", sys.executable, "-m",
         "kvkeeper.cli", "verify", "--root", str(root), "--socket",
         str(short_dir / "none.sock")], capture_output=True, text=True, timeout=120)
    text = " ".join(r.stdout.split())
    assert r.returncode == 1 and f"NOT CHECKED {theirs}: Permission denied" in text, r.stdout
    assert "1 not checked" in text and "BAD" not in text
    # A model's directory it cannot list: before, a bare "[Errno 13] Permission
    # denied", exit 1, and no JSON even with --json.
    theirs.chmod(0o600)
    theirs.parent.chmod(0)
    try:
        r = subprocess.run(
            ["setpriv", f"--bounding-set={drop}", f"--inh-caps={drop}", sys.executable, "-m",
             "kvkeeper.cli", "verify", "--root", str(root), "--socket",
             str(short_dir / "none.sock"), "--json"], capture_output=True, text=True, timeout=120)
    finally:
        theirs.parent.chmod(0o700)
    assert r.returncode == 1, (r.stdout, r.stderr[-3000:])
    report = json.loads(r.stdout or "null")
    assert report is not None and report["checked"] == 0, (report, r.stderr[-3000:])
    assert report["could_not_read"] == [{"path": str(theirs.parent),
                                         "reason": "Permission denied"}]


def test_the_daemon_leaves_a_file_it_cannot_identify_where_it_is(short_dir: Path) -> None:
    """The daemon took any error reading the file at an entry's place for
    "not another program's", so when it lacked permission (here root without
    the capabilities that override file modes; likewise out of descriptors)
    a save replaced another program's safetensors file at that place, and a
    repair moved a file to quarantine/, which the disk budget empties first.
    Now the save fails and the file stays: it cannot tell whose it is."""
    from safetensors.numpy import load_file, save_file

    from .conftest import serve_process, stop_process
    from .faultkit import need_linux_root

    need_linux_root()
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    drop = "-dac_override,-dac_read_search"
    daemon = serve_process(root, sock, prefix=("setpriv", f"--bounding-set={drop}",
                                               f"--inh-caps={drop}"))
    try:
        with Client(sock, timeout=WAIT) as kv:
            assert kv.save(FP, "damaged", filled(0.5, 2), [2]) and kv.flush(timeout=WAIT)
            theirs = entry_path(root, "theirs")
            weights = {"w": np.arange(64, dtype=np.float32)}
            save_file(weights, str(theirs), metadata={"format": "pt"})
            theirs.chmod(0)
            assert kv.save(FP, "theirs", filled(0.5, 3), [3])
            assert kv.flush(timeout=WAIT) is False
            assert kv.stats()["saves_failed"] == 1
            # So does a delete of the key (the file could be anyone's).
            with pytest.raises(DaemonError, match="cannot tell whether"):
                kv.delete(FP, "theirs")
            # This test runs as full root: it may read what the daemon may not.
            assert (theirs.stat().st_mode & 0o777) == 0
            assert np.array_equal(load_file(str(theirs))["w"], weights["w"])

            # A damaged cache the daemon may not read: verify (full root) finds
            # it bad and asks the daemon to move it aside; the daemon refuses.
            damaged = entry_path(root, "damaged")
            raw = bytearray(damaged.read_bytes())
            raw[-1] ^= 0xFF
            damaged.write_bytes(bytes(raw))
            damaged.chmod(0)
            r = subprocess.run(
                [sys.executable, "-m", "kvkeeper.cli", "verify", "--root", str(root),
                 "--socket", str(sock), "--repair", "--json"],
                capture_output=True, text=True, timeout=120)
            report = json.loads(r.stdout or "null")
            assert report is not None, r.stderr[-3000:]
            assert [b["path"] for b in report["bad"]] == [str(damaged)], report
            assert report["moved_aside"] == [] and "repair_error" not in report, report
            [why] = report["not_moved"]
            assert why["path"] == str(damaged), report
            assert "cannot tell whether" in why["reason"] and "Permission denied" in why["reason"]
            assert r.returncode == 1, r.stderr
            r = subprocess.run(
                [sys.executable, "-m", "kvkeeper.cli", "verify", "--root", str(root),
                 "--socket", str(sock), "--repair"], capture_output=True, text=True, timeout=120)
            text = " ".join(r.stdout.split())
            assert f"BAD {damaged}: checksum mismatch" in text, text
            assert "(not moved: moving aside failed: cannot tell whether" in text, text
            assert "1 bad" in text, text
            assert r.returncode == 1, r.stderr
            assert damaged.read_bytes() == bytes(raw)
            quarantine = root / "quarantine"
            assert not quarantine.exists() or not any(quarantine.iterdir())
    finally:
        assert stop_process(daemon) == 0
    said = " ".join(daemon_log(daemon).split())
    assert f"cannot tell whether {theirs} is a cache or another program's file" in said, said
    assert f"cannot tell whether {damaged} is a cache" in said, said
