"""A save whose bytes stop coming part way, from a client that is alive and
connected (paused, stopped with Ctrl-Z, slow), makes way for the jobs behind
it instead of holding the single writer for its stall timeout."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from safetensors import safe_open

from kvkeeper.daemon.app import Daemon, DaemonConfig
from kvkeeper.protocol import messages as m

from .conftest import (
    WAIT,
    RunningDaemon,
    daemon_log,
    dealers,
    serve_process,
    start_daemon,
    stop_process,
    wait_for,
    wait_for_log,
)
from .faultkit import tmp_files
from .test_cli_checks import cli
from .test_protocol_edge import ask, begin

V = m.PROTOCOL_VERSION
HALF = 2**20  # the stalled save sends this much of its 2 MiB, then pauses


@pytest.fixture
def patient(short_dir: Path) -> Iterator[RunningDaemon]:
    """A daemon whose stall timeout is far beyond any wait of these tests: a
    save behind a stalled one gets through only if the writer moves on."""
    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock", stall_timeout=600)
    try:
        yield rd
    finally:
        if rd.thread.is_alive():
            rd.stop()


def entry(rd: RunningDaemon, cache_id: str) -> Path:
    return rd.root / "sessions" / "fp" / f"{cache_id}.safetensors"


def content(path: Path) -> bytes:
    """The tensor, read back with the safetensors package."""
    with safe_open(str(path), "np") as f:
        return f.get_tensor("t0").tobytes()


def start_stalled(root: Path, s: zmq.Socket, cache_id: str) -> None:
    """Begin a 2 MiB save, send its first half, and return once the writer
    has started writing it (its tmp file exists under ``root``)."""
    s.send(begin(save=1, cache_id=cache_id, tensors=[m.TensorSpec("t0", "U8", [2 * HALF])]))
    s.send_multipart([m.encode(m.SaveData(v=V, save=1, frames=1)), b"a" * HALF])
    wait_for(lambda: tmp_files(root) != [], "the stalled save's tmp file")


def finish_stalled(s: zmq.Socket) -> None:
    s.send_multipart([m.encode(m.SaveData(v=V, save=1, frames=1)), b"b" * HALF])


def load_waits_for_the_stalled_save(slow: zmq.Socket) -> None:
    """The stalled client loads its key: no answer until it sends the rest of
    its save, then the file holding that whole save."""
    slow.send(m.encode(m.Load(v=V, req=99, model="fp", cache_id="k")))
    assert not slow.poll(700), "answered before the stalled save was written"
    finish_stalled(slow)
    found = m.decode_reply(slow.recv())
    assert isinstance(found, m.Found) and found.path
    assert content(Path(found.path)) == b"a" * HALF + b"b" * HALF


def save_whole(s: zmq.Socket, cache_id: str, fill: bytes, req: int = 1, *,
               send_only: bool = False, nbytes: int = 1000) -> m.Reply | None:
    """A save (``nbytes``, small by default) sent whole, then a flush;
    returns the flush's answer."""
    s.send(begin(save=1, cache_id=cache_id, tensors=[m.TensorSpec("t0", "U8", [nbytes])]))
    s.send_multipart([m.encode(m.SaveData(v=V, save=1, frames=1)), fill * nbytes])
    return None if send_only else ask(s, m.encode(m.Flush(v=V, req=req)))


def test_a_stalled_save_lets_others_by_and_is_written_whole_when_it_resumes(
    patient: RunningDaemon,
) -> None:
    with dealers(patient.socket, 2) as (slow, other):
        start_stalled(patient.root, slow, "slow")
        # The writer is inside the slow save; with no parking this flush
        # would wait out the 600 s stall timeout (and time out after WAIT).
        assert save_whole(other, "other", b"o") == m.Flushed(
            v=V, req=1, written=1, superseded=0, failed=0)
        assert content(entry(patient, "other")) == b"o" * 1000
        assert not entry(patient, "slow").exists()
        parked = ask(other, m.encode(m.GetStats(v=V, req=2)))
        assert isinstance(parked, m.Stats)
        assert parked.counters["parked_saves"] == 1 and parked.counters["saves_parked"] == 1
        finish_stalled(slow)
        assert ask(slow, m.encode(m.Flush(v=V, req=2))) == m.Flushed(
            v=V, req=2, written=1, superseded=0, failed=0)
        # Resumed in the same tmp file: both halves, in order, and the
        # checksums the header holds (hashed across the pause) are right.
        assert content(entry(patient, "slow")) == b"a" * HALF + b"b" * HALF
        r = cli("verify", "--socket", str(patient.socket), "--json")
        assert r.returncode == 0 and json.loads(r.stdout)["checked"] == 2, r.stdout + r.stderr
        got = ask(slow, m.encode(m.GetStats(v=V, req=3)))
        assert isinstance(got, m.Stats)
        assert got.counters["saves_failed"] == 0 and got.counters["pending_bytes"] == 0
        assert got.counters["parked_saves"] == 0
    assert tmp_files(patient.root) == []


def test_saves_silent_since_before_the_writer_took_them_do_not_each_hold_it(
    patient: RunningDaemon,
) -> None:
    """80 saves begun and then silent, already queued: each was given a
    whole PARK_AFTER (0.5 s) from when the writer took it, so a save behind
    them waited 40 s (20 of them: 9.9 s). Those silent for that long by
    then are parked at once."""
    with dealers(patient.socket, 81) as socks:
        *silent, good = socks
        for i, s in enumerate(silent):
            s.send(begin(save=1, cache_id=f"silent{i}", tensors=[m.TensorSpec("t0", "U8", [16])]))
        assert save_whole(good, "good", b"g") == m.Flushed(  # within WAIT (30 s)
            v=V, req=1, written=1, superseded=0, failed=0)
        assert content(entry(patient, "good")) == b"g" * 1000


def test_a_newer_save_of_the_key_replaces_the_stalled_one(patient: RunningDaemon) -> None:
    with dealers(patient.socket, 2) as (slow, other):
        start_stalled(patient.root, slow, "k")
        assert save_whole(other, "k", b"n") == m.Flushed(
            v=V, req=1, written=1, superseded=0, failed=0)
        assert content(entry(patient, "k")) == b"n" * 1000
        assert tmp_files(patient.root) == []  # the stalled save's tmp file is gone
        # Its bytes coming later change nothing: it was replaced, and its
        # client hears so.
        finish_stalled(slow)
        assert ask(slow, m.encode(m.Flush(v=V, req=2))) == m.Flushed(
            v=V, req=2, written=0, superseded=1, failed=0)
        assert content(entry(patient, "k")) == b"n" * 1000


def test_a_delete_of_the_key_replaces_the_stalled_save(patient: RunningDaemon) -> None:
    with dealers(patient.socket, 2) as (slow, other):
        assert save_whole(other, "k", b"o") == m.Flushed(
            v=V, req=1, written=1, superseded=0, failed=0)
        start_stalled(patient.root, slow, "k")
        deleted = ask(other, m.encode(m.Delete(v=V, req=2, model="fp", cache_id="k")))
        assert deleted == m.Deleted(v=V, req=2, existed=True)
        assert not entry(patient, "k").exists() and tmp_files(patient.root) == []
        finish_stalled(slow)
        assert ask(slow, m.encode(m.Flush(v=V, req=3))) == m.Flushed(
            v=V, req=3, written=0, superseded=1, failed=0)
        assert not entry(patient, "k").exists()


def test_a_load_of_the_key_waits_for_the_stalled_save(patient: RunningDaemon) -> None:
    # Read-your-writes holds for a parked save too: the client's own load
    # is answered once the save it sent before is written.
    with dealers(patient.socket, 2) as (slow, other):
        start_stalled(patient.root, slow, "k")
        assert save_whole(other, "x", b"x")  # the stalled save is parked meanwhile
        load_waits_for_the_stalled_save(slow)


def test_import_without_replace_leaves_a_key_whose_first_save_is_on_its_way(
        patient: RunningDaemon, short_dir: Path) -> None:
    """A live conversation's first save, received and not yet written, and
    an import of a backup of that key without --replace: the import looked
    for a file, found none, and its save replaced the conversation (exit 0,
    "imported"; the conversation's own flush said written; a review). Now
    the daemon checks as the import's save arrives and refuses it."""
    from kvkeeper import Client

    from .faultkit import filled, version_of

    backup = short_dir / "backup.safetensors"
    with Client(patient.socket, timeout=WAIT) as kv:
        assert kv.save("fp", "src", filled(0.01, 7), [7]) and kv.flush(timeout=WAIT)
    assert cli("export", "--socket", str(patient.socket), "fp", "src",
               str(backup)).returncode == 0
    with dealers(patient.socket, 1) as (slow,):
        start_stalled(patient.root, slow, "k")
        r = cli("import", "--socket", str(patient.socket), "--model", "fp", "--id", "k",
                str(backup), "--json")
        assert r.returncode == 1, (r.stdout, r.stderr)
        failed = json.loads(r.stdout)["failed"]
        assert [f["reason"] for f in failed] == [
            "fp / k is already in the store, or a save of it is on its way (give --replace "
            "to replace it)"], failed
        finish_stalled(slow)
        assert ask(slow, m.encode(m.Flush(v=V, req=2))) == m.Flushed(
            v=V, req=2, written=1, superseded=0, failed=0)
    assert content(entry(patient, "k")) == b"a" * HALF + b"b" * HALF
    # With --replace, the backup replaces the entry, as asked.
    r = cli("import", "--socket", str(patient.socket), "--model", "fp", "--id", "k",
            str(backup), "--replace")
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert version_of(entry(patient, "k"), model="fp") == 7


def test_a_save_made_to_create_its_entry_is_refused_where_one_exists(
        patient: RunningDaemon) -> None:
    """SaveBegin(create=True): refused as ``exists`` when the key has a file
    (the other case, a save on its way, is the import test's above), taken
    where it has none; the refused save's bytes are dropped quietly."""
    with dealers(patient.socket, 1) as (s,):
        assert save_whole(s, "e", b"o") == m.Flushed(v=V, req=1, written=1, superseded=0,
                                                      failed=0)
        for n, key in ((2, "e"), (3, "f")):
            s.send(begin(save=n, cache_id=key, tensors=[m.TensorSpec("t0", "U8", [1000])],
                         create=True))
            s.send_multipart([m.encode(m.SaveData(v=V, save=n, frames=1)), b"c" * 1000])
        refused = m.decode_reply(s.recv())
        assert isinstance(refused, m.SaveRefused) and refused.save == 2 \
            and refused.code == "exists", refused
        assert ask(s, m.encode(m.Flush(v=V, req=4))) == m.Flushed(
            v=V, req=4, written=2, superseded=0, failed=1)
    assert content(entry(patient, "e")) == b"o" * 1000
    assert content(entry(patient, "f")) == b"c" * 1000


def test_a_save_made_to_create_its_entry_after_a_pending_delete_is_taken(
        short_dir: Path) -> None:
    """A delete of the key received and not yet done (the writer busy with
    another save), then a create save of it: the delete leaves no entry, so
    the create is written (it was refused as a save on its way: the daemon
    counted any job of the key, the delete too; a review)."""
    from kvkeeper import Client

    from .faultkit import filled

    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock, env={"KVKEEPER_TEST_FAULTS": "write_delay=3"})
    try:
        with Client(sock, timeout=WAIT) as kv, dealers(sock, 1) as (s,):
            # "b" exists: what takes the create is the delete before it.
            assert save_whole(s, "b", b"o", req=3) == m.Flushed(
                v=V, req=3, written=1, superseded=0, failed=0)
            assert kv.save("fp", "busy", filled(1, 1), [1])  # about 3 s to write
            wait_for(lambda: tmp_files(root) != [], "the writer at work")
            s.send(m.encode(m.Delete(v=V, req=1, model="fp", cache_id="b")))
            s.send(begin(save=2, cache_id="b", tensors=[m.TensorSpec("t0", "U8", [1000])],
                         create=True))
            s.send_multipart([m.encode(m.SaveData(v=V, save=2, frames=1)), b"c" * 1000])
            assert tmp_files(root) != [], "the writer was done before the create came"
            assert s.poll(WAIT * 1000), "no answer to the delete"
            assert m.decode_reply(s.recv()) == m.Deleted(v=V, req=1, existed=True)
            assert ask(s, m.encode(m.Flush(v=V, req=2))) == m.Flushed(
                v=V, req=2, written=2, superseded=0, failed=0)
            assert kv.flush(timeout=WAIT)
        assert content(root / "sessions" / "fp" / "b.safetensors") == b"c" * 1000
    finally:
        assert stop_process(proc) == 0


def test_moving_a_damaged_file_aside_goes_first_and_the_stalled_save_stays_pending(
    patient: RunningDaemon,
) -> None:
    with dealers(patient.socket, 2) as (slow, other):
        assert save_whole(other, "k", b"o")
        st = entry(patient, "k").stat()
        start_stalled(patient.root, slow, "k")
        moved = ask(other, m.encode(m.Quarantine(v=V, req=2, model="fp", cache_id="k",
                                                 ino=st.st_ino, mtime_ns=st.st_mtime_ns,
                                                 reason="test: unreadable")))
        assert moved == m.Deleted(v=V, req=2, existed=True)
        assert not entry(patient, "k").exists()
        # The stalled save is still the key's newest job: a load waits for it
        # instead of answering "missing" from the empty place.
        load_waits_for_the_stalled_save(slow)


def test_a_save_made_to_create_its_entry_while_a_file_is_moved_aside_from_a_pending_save(
        short_dir: Path) -> None:
    """A stalled save of the key, then its file moved aside (a damaged one),
    and a create save of the key once the file is gone but the move not
    yet done: the create was written and superseded the stalled save, the
    live conversation's (a review; the move's directory fsyncs widened)."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock, "--stall-timeout", "600",
                         env={"KVKEEPER_TEST_FAULTS": "moved_delay=3"})
    try:
        with dealers(sock, 3) as (slow, other, third):
            assert save_whole(other, "k", b"o")
            path = root / "sessions" / "fp" / "k.safetensors"
            st = path.stat()
            start_stalled(root, slow, "k")
            other.send(m.encode(m.Quarantine(v=V, req=2, model="fp", cache_id="k",
                                             ino=st.st_ino, mtime_ns=st.st_mtime_ns,
                                             reason="test: unreadable")))
            wait_for(lambda: not path.exists(), "the file moved aside")
            third.send(begin(save=1, cache_id="k", tensors=[m.TensorSpec("t0", "U8", [1000])],
                             create=True))
            third.send_multipart([m.encode(m.SaveData(v=V, save=1, frames=1)), b"c" * 1000])
            assert third.poll(WAIT * 1000), "no answer to the create"
            refused = m.decode_reply(third.recv())
            assert isinstance(refused, m.SaveRefused) and refused.code == "exists", refused
            assert other.poll(WAIT * 1000) and m.decode_reply(other.recv()) == m.Deleted(
                v=V, req=2, existed=True)
            finish_stalled(slow)
            assert ask(slow, m.encode(m.Flush(v=V, req=3))) == m.Flushed(
                v=V, req=3, written=1, superseded=0, failed=0)
        assert content(path) == b"a" * HALF + b"b" * HALF
    finally:
        assert stop_process(proc) == 0


def failed_stalled(slow: zmq.Socket, stall: str) -> None:
    """Flush the stalled client: it is told its save failed (its client is
    alive: its loads must not take the older file as settled), then the
    flush says so."""
    said = ask(slow, m.encode(m.Flush(v=V, req=2)))
    assert said == m.SaveRefused(v=V, save=1, code="internal", message=f"writing it failed: "
                                 f"no bytes for {stall} s ({HALF} of {2 * HALF} received)")
    assert m.decode_reply(slow.recv()) == m.Flushed(v=V, req=2, written=0, superseded=0,
                                                    failed=1)


def test_a_stalled_save_still_fails_after_the_stall_timeout(short_dir: Path) -> None:
    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock", stall_timeout=2)
    try:
        with dealers(rd.socket, 2) as (slow, other):
            start_stalled(rd.root, slow, "slow")
            assert save_whole(other, "other", b"o") == m.Flushed(
                v=V, req=1, written=1, superseded=0, failed=0)
            failed_stalled(slow, "2")
            assert tmp_files(rd.root) == [] and not entry(rd, "slow").exists()
            got = ask(other, m.encode(m.GetStats(v=V, req=3)))
            assert isinstance(got, m.Stats) and got.counters["saves_cut_off"] == 0
    finally:
        assert rd.stop() == 0


def test_the_stall_timeout_is_a_serve_setting(short_dir: Path) -> None:
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock, "--stall-timeout", "1")
    try:
        # With the default 10 s, the flush's answer would not come within 5 s.
        with dealers(sock, 1, timeout=5) as (slow,):
            start_stalled(root, slow, "slow")
            failed_stalled(slow, "1")
            assert tmp_files(root) == []
    finally:
        code = stop_process(proc)
    assert code == 0


@pytest.mark.parametrize("stall_timeout", [0, -1, float("inf"), float("nan")])
def test_a_daemon_needs_a_stall_timeout_above_zero(short_dir: Path, stall_timeout: float) -> None:
    with pytest.raises(ValueError, match="stall_timeout"):
        Daemon(DaemonConfig(root=short_dir / "root", socket=short_dir / "kv.sock",
                            stall_timeout=stall_timeout))


@pytest.mark.parametrize("resumes", [True, False])
def test_the_drain_finishes_or_cleans_up_a_parked_save(short_dir: Path, resumes: bool) -> None:
    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock",
                      stall_timeout=600, drain_timeout=3)
    with dealers(rd.socket, 2) as (slow, other):
        start_stalled(rd.root, slow, "slow")
        assert save_whole(other, "other", b"o")  # parks the slow save
        rd.daemon.stop()
        if resumes:  # its bytes come during the drain: it is written
            finish_stalled(slow)
        rd.thread.join(WAIT)
        assert not rd.thread.is_alive()
    assert rd.exit_code == [0 if resumes else 1]
    assert tmp_files(rd.root) == []
    if resumes:
        assert content(entry(rd, "slow")) == b"a" * HALF + b"b" * HALF
    else:
        assert not entry(rd, "slow").exists()


def test_a_save_parked_during_the_drain_is_written(short_dir: Path) -> None:
    # SIGTERM comes while the writer is inside a trickling save, with two
    # saves queued behind it: the first of them stalls once its turn comes
    # and is parked during the drain, then its bytes come.
    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock",
                      stall_timeout=600, drain_timeout=15)
    with dealers(rd.socket, 3) as (trickling, slow, last):
        trickling.send(begin(save=1, cache_id="first",
                             tensors=[m.TensorSpec("t0", "U8", [64 * 1024])]))

        def trickle(n: int) -> None:
            for _ in range(n):  # a KiB every 0.1 s: slow, never parked
                trickling.send_multipart([m.encode(m.SaveData(v=V, save=1, frames=1)),
                                          b"f" * 1024])
                time.sleep(0.1)

        trickle(1)
        wait_for(lambda: tmp_files(rd.root) != [], "the trickling save's tmp file")
        slow.send(begin(save=1, cache_id="slow", tensors=[m.TensorSpec("t0", "U8", [2 * HALF])]))
        slow.send_multipart([m.encode(m.SaveData(v=V, save=1, frames=1)), b"a" * HALF])
        assert save_whole(last, "last", b"l", send_only=True) is None
        trickle(3)
        rd.daemon.stop()
        trickle(3)
        trickling.send_multipart([m.encode(m.SaveData(v=V, save=1, frames=1)),
                                  b"f" * (57 * 1024)])
        time.sleep(1.5)  # the slow save's turn, its stall, and "last" waiting: parked
        finish_stalled(slow)
        rd.thread.join(WAIT)
        assert not rd.thread.is_alive()
    assert rd.exit_code == [0]
    assert content(entry(rd, "first")) == b"f" * (64 * 1024)
    assert content(entry(rd, "slow")) == b"a" * HALF + b"b" * HALF
    assert content(entry(rd, "last")) == b"l" * 1000
    assert tmp_files(rd.root) == []


def test_a_save_replaced_while_it_replaces_a_parked_one_passes_its_client_on(
    short_dir: Path,
) -> None:
    # Replacing a parked save removes its tmp file in a worker thread (made
    # slow here); meanwhile the replacing save is itself replaced, and that
    # one fails. The parked save's client must hear of the failure, and the
    # writer must not write the save it had in hand, now finished.
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock, env={"KVKEEPER_TEST_FAULTS": "abort_delay=2"})
    try:
        with dealers(sock, 2) as (slow, other):
            slow.send(begin(save=1, cache_id="k",
                            tensors=[m.TensorSpec("t0", "U8", [2 * HALF])]))
            slow.send_multipart([m.encode(m.SaveData(v=V, save=1, frames=1)), b"a" * HALF])
            wait_for(lambda: tmp_files(root) != [], "the stalled save's tmp file")
            assert save_whole(other, "k", b"2", send_only=True) is None
            # Parked after 0.5 s, then replaced: its tmp file goes for 2 s,
            # from this line on (a fixed 1.2 s missed it on a late park).
            wait_for_log(proc, "step=abort_delay", "the parked save's tmp file to be going")
            other.send(begin(save=2, cache_id="k", tensors=[m.TensorSpec("t0", "U8", [1000])]))
            other.send_multipart([m.encode(m.SaveData(v=V, save=2, frames=1)), b"3" * 500])
            # A new save of the same client abandons that one half way: it fails.
            other.send(begin(save=3, cache_id="x", tensors=[m.TensorSpec("t0", "U8", [10])]))
            other.send_multipart([m.encode(m.SaveData(v=V, save=3, frames=1)), b"x" * 10])
            assert ask(other, m.encode(m.Flush(v=V, req=1))) == m.Flushed(
                v=V, req=1, written=1, superseded=1, failed=1)
            # The parked save went with the save that replaced it: told at once.
            assert ask(slow, m.encode(m.Flush(v=V, req=2))) == m.SaveRefused(
                v=V, save=1, code="internal",
                message="the save that replaced it failed: the client abandoned it part way")
            assert m.decode_reply(slow.recv()) == m.Flushed(
                v=V, req=2, written=0, superseded=1, failed=1)
            assert not (root / "sessions" / "fp" / "k.safetensors").exists()
    finally:
        assert stop_process(proc) == 0
    assert "event=save_parked model=fp id=k received=1000" not in daemon_log(proc)


def test_a_gc_while_a_save_is_parked_leaves_no_phantom_file_in_the_budget(
    short_dir: Path,
) -> None:
    """A gc rescans the root while a save is parked: it finds the save's tmp
    file and counts it. Once that file is renamed into place it must no
    longer be counted (it was, until the next rescan: 5 MiB that did not
    exist pushed the store over its budget and evicted an entry)."""
    MiB = 2**20
    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock", stall_timeout=600,
                      max_disk_bytes=10 * MiB, min_write_interval=0.0)
    try:
        with dealers(rd.socket, 3) as (a, slow, g):
            a.send(begin(save=1, cache_id="old", tensors=[m.TensorSpec("t0", "U8", [3 * MiB])]))
            a.send_multipart([m.encode(m.SaveData(v=V, save=1, frames=1)), b"o" * (3 * MiB)])
            assert ask(a, m.encode(m.Flush(v=V, req=1))) == m.Flushed(
                v=V, req=1, written=1, superseded=0, failed=0)
            slow.send(begin(save=1, cache_id="big", tensors=[m.TensorSpec("t0", "U8", [6 * MiB])]))
            slow.send_multipart([m.encode(m.SaveData(v=V, save=1, frames=1)), b"a" * (5 * MiB)])
            wait_for(lambda: tmp_files(rd.root) != [], "the paused save's tmp file")
            assert isinstance(ask(g, m.encode(m.Gc(v=V, req=2))), m.Evicted)  # it parks the save
            slow.send_multipart([m.encode(m.SaveData(v=V, save=1, frames=1)), b"b" * MiB])
            assert ask(slow, m.encode(m.Flush(v=V, req=3))) == m.Flushed(
                v=V, req=3, written=1, superseded=0, failed=0)
            listed = ask(g, m.encode(m.ListEntries(v=V, req=4, everything=True)))
            assert isinstance(listed, m.Entries)
            assert sorted((e.kind, e.cache_id) for e in listed.entries) == [
                ("entry", "big"), ("entry", "old")]
            stats = ask(g, m.encode(m.GetStats(v=V, req=5)))
            assert isinstance(stats, m.Stats)
            on_disk = sum(p.stat().st_size for p in (entry(rd, "old"), entry(rd, "big")))
            assert stats.counters["disk_used_bytes"] == on_disk
            assert stats.counters["evictions"] == 0
        assert content(entry(rd, "old")) == b"o" * (3 * MiB)
    finally:
        rd.stop()


@pytest.mark.parametrize("frame", [b"", b"x"], ids=["empty frames", "one byte at a time"])
def test_a_trickling_save_lets_others_by(patient: RunningDaemon, frame: bytes) -> None:
    """A client that sends its save a few bytes (or none) at a time, every
    0.2 s, holds the writer as surely as one that sends nothing: each frame
    used to count as progress, and another client's flush went unanswered
    for as long as the trickle lasted."""
    with dealers(patient.socket, 2) as (slow, other):
        start_stalled(patient.root, slow, "slow")
        stop, sent = threading.Event(), [0]

        def trickle() -> None:
            while not stop.wait(0.2):
                slow.send_multipart([m.encode(m.SaveData(v=V, save=1, frames=1)), frame])
                sent[0] += 1

        t = threading.Thread(target=trickle)
        t.start()
        try:
            assert save_whole(other, "other", b"o") == m.Flushed(
                v=V, req=1, written=1, superseded=0, failed=0)
        finally:
            stop.set()
            t.join(WAIT)
        assert content(entry(patient, "other")) == b"o" * 1000
        trickled = frame * sent[0]
        rest = b"b" * (2 * HALF - HALF - len(trickled))
        slow.send_multipart([m.encode(m.SaveData(v=V, save=1, frames=1)), rest])
        assert ask(slow, m.encode(m.Flush(v=V, req=2))) == m.Flushed(
            v=V, req=2, written=1, superseded=0, failed=0)
        assert content(entry(patient, "slow")) == b"a" * HALF + trickled + rest


def test_empty_frames_do_not_keep_a_stalled_save_alive(short_dir: Path) -> None:
    """The stall timeout counts from the last byte: a stream of empty frames
    does not put it off (it did, for ever)."""
    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock", stall_timeout=1.0)
    try:
        with dealers(rd.socket, 1) as (slow,):
            start_stalled(rd.root, slow, "slow")
            deadline = time.monotonic() + WAIT
            told = []
            while True:
                slow.send_multipart([m.encode(m.SaveData(v=V, save=1, frames=1)), b""])
                stats = ask(slow, m.encode(m.GetStats(v=V, req=1)))
                if isinstance(stats, m.SaveRefused):  # the stalled save's notice
                    told.append(stats.message)
                    stats = m.decode_reply(slow.recv())
                assert isinstance(stats, m.Stats)
                if stats.counters["saves_failed"] == 1:
                    break
                assert time.monotonic() < deadline, "the save never failed"
                time.sleep(0.2)
            assert tmp_files(rd.root) == []
            if not told:  # failed after the last stats asked: its notice comes next
                said = m.decode_reply(slow.recv())
                assert isinstance(said, m.SaveRefused), said
                told.append(said.message)
            assert told == [f"writing it failed: no bytes for 1 s ({HALF} of {2 * HALF} "
                            f"received)"], told
    finally:
        rd.stop()


def test_a_save_parked_with_bytes_unwritten_fails_one_stall_timeout_after_them(
    short_dir: Path,
) -> None:
    """A trickle that stops right after the writer parks its save: the bytes
    that came last are written when the save is taken again, and they used to
    restart the stall timeout then, so the save failed about two timeouts
    after its last byte instead of one."""
    stall = 4.0
    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock", stall_timeout=stall)
    try:
        with dealers(rd.socket, 3) as (slow, other, watch):
            start_stalled(rd.root, slow, "slow")
            save_whole(other, "other", b"o", send_only=True)  # queued: the writer may park
            deadline = time.monotonic() + WAIT
            while True:
                slow.send_multipart([m.encode(m.SaveData(v=V, save=1, frames=1)), b"x"])
                last_byte = time.monotonic()
                time.sleep(0.15)  # the writer parks the save as this byte wakes it, or not
                stats = ask(watch, m.encode(m.GetStats(v=V, req=1)))
                assert isinstance(stats, m.Stats)
                if stats.counters["saves_parked"] >= 1:
                    break
                assert time.monotonic() < deadline, "the save was never parked"
                time.sleep(0.05)
            while True:
                stats = ask(watch, m.encode(m.GetStats(v=V, req=2)))
                assert isinstance(stats, m.Stats)
                if stats.counters["saves_failed"] == 1:
                    break
                assert time.monotonic() - last_byte < 1.5 * stall, (
                    "the parked save outlived its stall timeout by half as much again")
                time.sleep(0.05)
            assert time.monotonic() - last_byte > stall * 0.9
            assert tmp_files(rd.root) == [] and not entry(rd, "slow").exists()
            assert content(entry(rd, "other")) == b"o" * 1000
    finally:
        assert rd.stop() == 0


def evictions_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The evictions the store logged, in order: id, reason and what follows."""
    return [re.sub(r".* (id=\S+) bytes=\d+ kind=entry ", r"\1 ", r.getMessage())
            for r in caplog.records if "event=evicted" in r.getMessage()]


def save_mib_entries(dealer: zmq.Socket, entries: list[tuple[str, bytes]]) -> None:
    """Entries of 1 MiB each (id, fill byte), written in this order (req 1, 2, ...)."""
    for i, (name, fill) in enumerate(entries):
        assert save_whole(dealer, name, fill, i + 1, nbytes=2**20) == m.Flushed(
            v=V, req=i + 1, written=i + 1, superseded=0, failed=0)


@pytest.mark.parametrize("sent", [HALF, 0], ids=["half sent", "no byte sent"])
def test_the_old_file_of_a_key_being_saved_is_not_evicted(
    short_dir: Path, sent: int, caplog: pytest.LogCaptureFixture,
) -> None:
    """The key's file is the least recently used when a save of it stalls and
    another save pushes the store over its budget. Evicting that file left
    nothing of the key once the stalled save failed (its client gone for
    good): the eviction takes the next entry instead. (With no byte sent,
    the stalled save has no tmp file yet.)"""
    MiB = 2**20
    caplog.set_level(logging.INFO, logger="kvkeeper.store")
    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock", stall_timeout=2,
                      max_disk_bytes=MiB * 9 // 2, min_write_interval=0.0)
    try:
        with dealers(rd.socket, 2) as (slow, other):
            save_mib_entries(other, [("k", b"o"), ("a", b"a")])
            if sent:
                start_stalled(rd.root, slow, "k")
            else:
                slow.send(begin(save=1, cache_id="k",
                                tensors=[m.TensorSpec("t0", "U8", [2 * HALF])]))
                wait_for(lambda: ask(other, m.encode(m.GetStats(v=V, req=9)))
                         .counters["saves_received"] == 3, "the stalled save")
            # k (1 MiB, the oldest) + a (1 MiB) + b (3 MiB) is over 4.5 MiB.
            assert save_whole(other, "b", b"b", 3, nbytes=3 * MiB) == m.Flushed(
                v=V, req=3, written=3, superseded=0, failed=0)
            assert not entry(rd, "a").exists()
            assert content(entry(rd, "k")) == b"o" * MiB
            assert evictions_logged(caplog) == ["id=a reason=max_disk_bytes save_pending=0"]
            # The stalled save fails (told at once): the key still has the file it had.
            told = ask(slow, m.encode(m.Flush(v=V, req=4)))
            assert isinstance(told, m.SaveRefused) and told.message.startswith(
                "writing it failed: no bytes for 2 s"), told
            assert m.decode_reply(slow.recv()) == m.Flushed(
                v=V, req=4, written=0, superseded=0, failed=1)
            assert content(entry(rd, "k")) == b"o" * MiB
            stats = ask(other, m.encode(m.GetStats(v=V, req=5)))
            assert isinstance(stats, m.Stats)
            assert stats.counters["evictions"] == 1
            assert stats.counters["disk_used_bytes"] == sum(
                entry(rd, n).stat().st_size for n in ("k", "b"))
        assert tmp_files(rd.root) == []
    finally:
        assert rd.stop() == 0


def test_a_key_being_saved_is_evicted_last_but_the_budget_holds(
    short_dir: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """As above, but b (3.5 MiB) fits only with both k and a gone: k goes
    too, after a, and the log says a save of it was on its way. Never
    evicting it would leave the store over its budget for as long as more
    keys are being saved than it has room for."""
    MiB = 2**20
    caplog.set_level(logging.INFO, logger="kvkeeper.store")
    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock", stall_timeout=600,
                      max_disk_bytes=MiB * 9 // 2, min_write_interval=0.0)
    try:
        with dealers(rd.socket, 2) as (slow, other):
            save_mib_entries(other, [("a", b"a"), ("k", b"o")])  # a is the oldest
            start_stalled(rd.root, slow, "k")
            assert save_whole(other, "b", b"b", 3, nbytes=7 * MiB // 2) == m.Flushed(
                v=V, req=3, written=3, superseded=0, failed=0)
            assert not entry(rd, "a").exists() and not entry(rd, "k").exists()
            assert evictions_logged(caplog) == ["id=a reason=max_disk_bytes save_pending=0",
                                                "id=k reason=max_disk_bytes save_pending=1"]
            stats = ask(other, m.encode(m.GetStats(v=V, req=4)))
            assert isinstance(stats, m.Stats)
            assert stats.counters["evictions"] == 2
            assert stats.counters["disk_used_bytes"] == entry(rd, "b").stat().st_size
            # The stalled save, resumed, is written: the key has its new version.
            finish_stalled(slow)
            assert ask(slow, m.encode(m.Flush(v=V, req=5))) == m.Flushed(
                v=V, req=5, written=1, superseded=0, failed=0)
            assert content(entry(rd, "k")) == b"a" * HALF + b"b" * HALF
    finally:
        assert rd.stop() == 0
