"""The client's own counters account for every save ``save()`` handed off.

A save that returned True ends up sent, lost or coalesced, exactly once,
however ``close()`` and the daemon's state cut its way short.
"""

from __future__ import annotations

import logging
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvkeeper.client.client import Client, DaemonTimedOut

from .conftest import (
    WAIT,
    drain_past_the_notice,
    serve_process,
    start_daemon,
    stop_process,
    wait_for,
)
from .faultkit import FP, entry_path, filled, version_of


def accounted(kv: Client) -> int:
    c = kv.client_stats()
    return int(c["client_saves_sent"] + c["client_saves_lost"] + c["client_saves_coalesced"])


@contextmanager
def daemon_stopped(short_dir: Path) -> Iterator[Client]:
    """A client of a ``kvkeeper serve`` process that is stopped (SIGSTOP: it
    reads nothing) inside the block, and resumed and shut down after it."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock)
    try:
        kv = Client(sock, timeout=WAIT, min_send_interval=0)
        assert kv.connected
        proc.send_signal(signal.SIGSTOP)
        try:
            yield kv
        finally:
            proc.send_signal(signal.SIGCONT)
    finally:
        assert stop_process(proc) == 0


def test_a_save_cut_short_by_close_counts_as_lost_not_also_sent(
        short_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    # 64 MiB cannot all leave before close() gives up on it.
    caplog.set_level(logging.WARNING, logger="kvkeeper.client")
    with daemon_stopped(short_dir) as kv:
        assert kv.save(FP, "big", filled(64, 1), [1])
        kv.close(timeout=0.5)
    c = kv.client_stats()
    assert c["client_saves_lost"] == 1, c
    assert c["client_saves_sent"] == 0 and c["client_bytes_sent"] == 0, c
    # And said, with whose it was (it was counted without a word).
    lost = [r.getMessage() for r in caplog.records if "saves_lost_at_close" in r.getMessage()]
    assert len(lost) == 1 and f"count=1 keys={FP}/big msg=" in lost[0], lost


def test_a_log_handler_that_raises_at_the_lost_saves_line_does_not_undo_close(
        short_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The line is logged in the I/O thread's last cleanup: a handler that
    raised there left the thread unfinished (close() waited 5 s more), the
    reservation held and the client still 'connected'."""

    class Raising(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "saves_lost_at_close" in record.getMessage():
                raise RuntimeError("a handler that fails")

    caplog.set_level(logging.WARNING, logger="kvkeeper.client")
    handler = Raising(logging.WARNING)
    logging.getLogger("kvkeeper.client").addHandler(handler)
    try:
        with daemon_stopped(short_dir) as kv:
            assert kv.save(FP, "big", filled(64, 1), [1])
            kv.close(timeout=0.5)
    finally:
        logging.getLogger("kvkeeper.client").removeHandler(handler)
    c = kv.client_stats()
    assert c["client_saves_lost"] == 1 and c["client_inflight_bytes"] == 0, c
    assert not kv.connected
    # Nor did close() wait for the thread ("did not end within 5 s").
    assert not [r for r in caplog.records if "client_close_slow" in r.getMessage()]


def _wait_until_part_sent(kv: Client) -> None:
    """Until the I/O thread has handed ZeroMQ some of the save it is sending:
    a save none of which went is kept for the next daemon, not lost (a fixed
    1 s stood for this, and a slow machine can take longer)."""
    def part_sent() -> bool:
        save = kv._channel._piping
        return save is not None and save.piped > 0

    wait_for(part_sent, "the save's first messages to go")


def test_a_save_cut_short_by_the_daemons_death_is_logged_lost_with_its_key(
        short_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The line read 'event=save_lost "reason=connection_lost"' (the reason
    quoted as one value) and named no key; a send refused mid-save said
    'error=Resource temporarily unavailable' for the same loss."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock)
    try:
        with Client(sock, timeout=WAIT, min_send_interval=0) as kv, \
                caplog.at_level(logging.WARNING, logger="kvkeeper"):
            proc.send_signal(signal.SIGSTOP)
            assert kv.save(FP, "big", filled(96, 2), [2])  # ZeroMQ takes 32 MiB of it
            _wait_until_part_sent(kv)
            proc.send_signal(signal.SIGKILL)
            wait_for(lambda: kv.client_stats()["client_saves_lost"] == 1, "the save to be lost")
    finally:
        stop_process(proc, signal.SIGKILL)
    lost = [r.getMessage() for r in caplog.records if "event=save_lost" in r.getMessage()]
    assert len(lost) == 1, lost
    assert re.fullmatch(rf"event=save_lost reason=connection_lost model={FP} id=big "
                        rf"sent_messages=[0-9]+", lost[0]), lost


def test_close_says_when_the_daemon_did_not_confirm_it_read_the_saves(
    short_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A small save leaves at once, but a stopped daemon never answers the
    ping close() sends after it: close() gives up after its timeout and says
    so in the log."""
    with daemon_stopped(short_dir) as kv:
        assert kv.save(FP, "small", filled(0.01, 1), [1])
        with caplog.at_level(logging.WARNING, logger="kvkeeper"):
            kv.close(timeout=1.0)
    assert "event=client_close_unconfirmed" in caplog.text
    assert kv.client_stats()["client_saves_sent"] == 1


def test_a_connection_lost_before_the_daemon_read_the_saves_is_logged(
    short_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A save ZeroMQ took while the daemon was stopped, then the daemon
    killed: nothing of it was read, and the client says so when the
    connection ends. A save a flush confirmed is not warned of again when
    the next daemon goes."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock)
    try:
        with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
            assert kv.save(FP, "read", filled(1, 1), [1])
            assert kv.flush(WAIT)
            proc.send_signal(signal.SIGSTOP)
            with caplog.at_level(logging.WARNING, logger="kvkeeper"):
                assert kv.save(FP, "unread", filled(1, 2), [2])
                wait_for(lambda: kv.client_stats()["client_saves_sent"] == 2, "the save sent")
                proc.kill()
                proc.wait(WAIT)
                wait_for(lambda: not kv.connected, "the connection to end")
                wait_for(lambda: "event=saves_unconfirmed" in caplog.text, "the warning")
            caplog.clear()
            proc = serve_process(root, sock)
            wait_for(lambda: kv.connected, "the reconnection")
            with caplog.at_level(logging.WARNING, logger="kvkeeper"):
                assert not kv.flush(WAIT)  # the unread save is gone
                assert kv.flush(WAIT)
                assert stop_process(proc) == 0
                wait_for(lambda: not kv.connected, "the connection to end")
                kv.close()
            assert "unconfirmed" not in caplog.text.replace("flush_unconfirmed", ""), caplog.text
    finally:
        stop_process(proc)


def test_a_flush_after_the_same_daemon_dropped_the_connection(
    short_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The daemon's ZeroMQ drops a connection on a frame over its size limit,
    and with it what it had not read from that connection (the frame is put
    on the client's socket directly: save() no longer sends one). A save
    sent behind such a frame never reached the same daemon, and the flush
    after the reconnection must not vouch for it; saves the daemon had
    confirmed reading before the drop are its to answer for, and the flush
    says True."""
    from kvkeeper.protocol import messages as m

    def drop_connection(kv: Client, *, then_save: bool) -> None:
        conn = kv._channel.connections
        proc.send_signal(signal.SIGSTOP)  # both are queued before it reads either
        try:
            kv._channel.notify(m.SaveBegin(
                v=m.PROTOCOL_VERSION, save=10**6, model=FP, cache_id="oversized",
                tensors=[], metadata={"x": "y" * (33 * 2**20)}))
            if then_save:
                sent = kv.client_stats()["client_saves_sent"]
                assert kv.save(FP, "behind", filled(1, 3), [3])
                wait_for(lambda: kv.client_stats()["client_saves_sent"] == sent + 1,
                         "the save sent")
        finally:
            proc.send_signal(signal.SIGCONT)
        wait_for(lambda: kv._channel.connections > conn and kv.connected, "a reconnection")

    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock, "--max-pending-bytes", "32M")
    try:
        with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
            assert kv.save(FP, "read", filled(1, 1), [1])
            assert kv.load(FP, "read") is not None  # answered: the daemon read the save
            drop_connection(kv, then_save=False)
            assert kv.flush(WAIT)
            drop_connection(kv, then_save=True)
            with caplog.at_level(logging.WARNING, logger="kvkeeper"):
                assert not kv.flush(WAIT)
            assert "event=flush_unconfirmed" in caplog.text
            assert kv.stats()["saves_received"] == 1  # it never saw the second
    finally:
        assert stop_process(proc) == 0


def test_a_client_that_only_loads_warns_of_no_unconfirmed_saves(
    short_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A direct load tells the daemon with a notice no reply confirms; its
    loss costs no data, and the client says nothing of it."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock)
    try:
        with Client(sock, timeout=WAIT) as kv:
            assert kv.save(FP, "k", filled(0.1, 1), [1])
            assert kv.flush(WAIT)
        with caplog.at_level(logging.WARNING, logger="kvkeeper"):
            with Client(sock, timeout=WAIT) as reader:
                assert reader.load(FP, "k") is not None
                assert reader.stats()["loads_direct"] == 1
                assert reader.load(FP, "k") is not None  # its notice: not answered
                proc.kill()
                proc.wait(WAIT)
                wait_for(lambda: not reader.connected, "the connection to end")
        assert "unconfirmed" not in caplog.text, caplog.text
    finally:
        stop_process(proc)


def test_a_save_whose_header_the_daemon_cannot_take_is_refused_or_counted_lost(
    short_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A header over the daemon's 32 MiB made ZeroMQ drop the connection, and
    the save with it, while the client counted it sent and the flush said
    True. Metadata that large is refused by save(); token ids that large
    (known only once encoded, on the I/O thread) make the save lost."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock, "--max-pending-bytes", "32M")
    try:
        with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
            with pytest.raises(ValueError, match="metadata is .* bytes as JSON"):
                kv.save(FP, "meta", filled(0.01, 1), [1], metadata={"x": "y" * (9 * 2**20)})
            with caplog.at_level(logging.WARNING, logger="kvkeeper"):
                assert kv.save(FP, "tokens", filled(0.01, 1), list(range(10**6, 7 * 10**6)))
                assert not kv.flush(WAIT)
            assert "header is" in caplog.text and "at most 33554432" in caplog.text
            c = kv.client_stats()
            assert (c["client_saves_lost"], c["client_saves_sent"]) == (1, 0), c
            assert kv.save(FP, "fine", filled(0.01, 1), [1], metadata={"x": "y" * 2**20})
            assert kv.flush(WAIT)
            assert kv.load(FP, "fine") is not None
    finally:
        assert stop_process(proc) == 0


def test_polling_flush_with_no_timeout_never_makes_the_daemon_turn_the_client_away(
    short_dir: Path,
) -> None:
    """A loop polling flush(timeout=0) while a slow write goes on leaves a
    request behind at the daemon per call (the client stops waiting, the
    daemon does not): 2000 of them, with a save before each (so no two wait
    for the same saves), must not make the daemon answer the client's other
    requests "busy" (its cap on waiting requests)."""
    from kvkeeper.client.channel import DaemonUnavailable
    from kvkeeper.daemon.faults import ENV

    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock, "--min-write-interval", "0", env={ENV: "write_delay=1.0"})
    try:
        with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
            assert kv.save(FP, "slow", filled(4, 1), [1])  # 4 s at 1 s per MiB
            timed_out, tiny = 0, filled(0.001, 1)
            for i in range(2000):
                assert kv.save(FP, f"tiny{i % 4}", tiny, [i])
                try:
                    kv.flush(timeout=0)
                except DaemonUnavailable:
                    timed_out += 1
            assert timed_out > 1024  # more than the daemon lets one client wait for
            kv.entries()  # answered, not "busy"
            assert kv.flush(WAIT)
            assert kv.delete(FP, "slow")
    finally:
        assert stop_process(proc) == 0


def save_until_closed(kv: Client, started: threading.Event, handed: list[int]) -> None:
    """Save in a loop until the client is closed, counting the saves handed off."""
    cache = filled(0.05, 1)  # made here: MLX evaluates an array on its own thread's stream
    while True:
        try:
            handed[0] += kv.save(FP, "race", cache, [1])
        except RuntimeError as exc:
            assert "client is closed" in str(exc)
            return
        finally:
            if handed[0]:
                started.set()  # the close races saves, not the first one


def test_saves_racing_close_are_each_sent_lost_or_dropped(short_dir: Path) -> None:
    """A thread saves in a loop while another closes the client, as the exit
    hook does beside a worker thread: no save that returned True vanishes."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock)
    try:
        for _ in range(12):
            kv = Client(sock, timeout=WAIT, min_send_interval=0)
            assert kv.connected
            handed, started = [0], threading.Event()
            t = threading.Thread(target=save_until_closed, args=(kv, started, handed))
            t.start()
            assert started.wait(WAIT)
            kv._channel.close(timeout=0.05)  # the exit hook's close: the Client is not marked
            kv.close()
            t.join(WAIT)
            assert not t.is_alive()
            assert handed[0] > 0
            assert accounted(kv) == handed[0], (kv.client_stats(), handed)
            assert kv._channel.inflight_bytes == 0
    finally:
        assert stop_process(proc) == 0


def test_concurrent_flushes_report_each_failure_once(short_dir: Path) -> None:
    """Threads sharing a client save and flush at once; some saves are too
    large for the disk budget and are refused. Every refusal makes some flush
    say False, and once they are all reported a flush says True."""
    from .conftest import start_daemon

    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock", max_disk_bytes=2**20)
    falses: list[int] = []
    try:
        with Client(rd.socket, timeout=WAIT, min_send_interval=0) as kv:

            def worker(i: int) -> None:
                small, big = filled(0.05, 1), filled(1.5, 2)  # on this thread's stream
                for j in range(12):
                    assert kv.save(FP, f"t{i}", big if j % 4 == 3 else small, [j])
                    if not kv.flush(timeout=WAIT):
                        falses.append(i)

            threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(WAIT * 2)
                assert not t.is_alive()
            s = kv.stats()
            refused = s["saves_refused"]
            assert refused == 12
            # Every refusal reached this client and nothing else went wrong: the
            # other 36 were written or replaced by a newer save of their key.
            assert s["client_saves_refused"] == 12, s
            assert s["client_saves_sent"] == 48 and s["client_saves_lost"] == 0, s
            assert s["saves_written"] + s["saves_superseded"] == 36 and s["saves_failed"] == 0, s
            assert 1 <= len(falses) <= refused
            # Nothing new failed: a failure already reported is not reported again.
            assert kv.flush(timeout=WAIT) is True
            assert kv.flush(timeout=WAIT) is True
    finally:
        assert rd.stop() == 0


def test_a_refusal_after_the_daemon_forgot_the_client_s_total_still_says_false(
        short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon keeps a failure total for 10,000 clients (3 here). A's
    total stood at 1 after a refusal; three other clients' refusals made the
    daemon forget it, and A's next refusal began it again at 1, the total A
    had last seen: A's flush said True for a save never written (a review,
    with 10,001 raw peers)."""
    from kvkeeper.daemon import actor

    from .conftest import start_daemon

    monkeypatch.setattr(actor, "_MAX_TALLIES", 3)
    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock", max_disk_bytes=2**20)
    try:
        with Client(rd.socket, timeout=WAIT, min_send_interval=0) as a:
            assert a.save(FP, "ok", filled(0.1, 1), [1]) and a.flush(timeout=WAIT) is True
            assert a.save(FP, "big", filled(1.5, 2), [2]) and a.flush(timeout=WAIT) is False
            for i in range(3):
                with Client(rd.socket, timeout=WAIT, min_send_interval=0) as other:
                    assert other.save(FP, f"o{i}", filled(1.5, 3), [3])
                    assert other.flush(timeout=WAIT) is False
            assert a.save(FP, "big", filled(1.5, 4), [4])
            assert a.flush(timeout=WAIT) is False
            assert a.client_stats()["client_saves_refused"] == 2
            assert a.save(FP, "ok", filled(0.1, 5), [5]) and a.flush(timeout=WAIT) is True
    finally:
        assert rd.stop() == 0


def test_refusals_are_logged_once_a_minute_per_code(
        short_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Each refused save logged a warning (a daemon shutting down or out of
    memory refuses every one); the counts are in stats()."""
    with _refusing(short_dir, caplog) as (kv, refuse):
        for j in range(5):
            refuse(j)
        assert kv.stats()["client_saves_refused"] == 5
    lines = [r.getMessage() for r in caplog.records if "event=save_refused" in r.getMessage()]
    assert len(lines) == 1, lines


@contextmanager
def _refusing(short_dir: Path, caplog: pytest.LogCaptureFixture,
              ) -> Iterator[tuple[Client, Callable[[int], None]]]:
    """A client of a daemon with a 1 MiB disk budget, its warnings captured,
    and ``refuse(j)``: a 1.5 MiB save the daemon refuses, flushed."""
    from .conftest import start_daemon

    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock", max_disk_bytes=2**20)
    caplog.set_level(logging.WARNING, logger="kvkeeper.client")
    try:
        with Client(rd.socket, timeout=WAIT, min_send_interval=0) as kv:
            def refuse(j: int) -> None:
                assert kv.save(FP, "big", filled(1.5, j), [j])
                assert kv.flush(timeout=WAIT) is False

            yield kv, refuse
    finally:
        assert rd.stop() == 0


def test_a_refusal_logged_after_quiet_ones_counts_them_in_a_field_of_its_own(
        short_dir: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The count of refusals not logged was glued to the end of ``detail``
    (and an empty one logged as ``""`` after its closing quote): the line was
    not logfmt. Each key now appears once, with one well-formed value."""
    import kvkeeper.client.client as client_module

    monkeypatch.setattr(client_module, "LOG_EVERY_SECONDS", 0.5)
    with _refusing(short_dir, caplog) as (_, refuse):
        for j in range(3):
            refuse(j)
        time.sleep(0.6)
        refuse(9)
    lines = [r.getMessage() for r in caplog.records if "event=save_refused" in r.getMessage()]
    pair = re.compile(r'([a-z_]+)=("(?:[^"\\]|\\.)*"|[^\s"]+)(?: |$)')
    fields = []
    for line in lines:
        assert "".join(m.group(0) for m in pair.finditer(line)).rstrip() == line, line
        keys = [m.group(1) for m in pair.finditer(line)]
        # (With the key refused: before, a line said neither model nor id.)
        assert keys == ["event", "model", "id", "code", "detail", "not_logged_since"], line
        fields.append(dict((m.group(1), m.group(2)) for m in pair.finditer(line)))
    assert [f["not_logged_since"] for f in fields] == ["0", "2"], lines
    assert [(f["model"], f["id"]) for f in fields] == [(FP, "big")] * 2, lines


#: What each batch saves before its flush: small saves that fit, and saves
#: over the disk budget that the daemon refuses ("big"), or over the client's
#: in-flight budget that save() itself drops ("huge").
BATCHES = [
    ("small", "small", "small"),
    ("small", "big", "small"),
    ("small", "small"),
    ("big",),
    ("small",),
    ("big", "small", "big"),
    ("small", "huge", "small"),
    ("small",),
]

COUNTS = ("saves_received", "saves_written", "saves_superseded", "saves_refused",
          "saves_failed", "client_saves_sent", "client_saves_refused",
          "client_saves_dropped", "client_saves_lost", "client_saves_coalesced")


def test_each_refusal_is_reported_by_the_flush_of_its_batch(short_dir: Path) -> None:
    """One thread, batches of saves each closed by a flush: a flush says False
    exactly when its batch holds a refused save, and the next flush, of a batch
    without one, says True; the counters move by exactly the batch's saves."""
    from .conftest import start_daemon

    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock", max_disk_bytes=2**20)
    try:
        with Client(rd.socket, timeout=WAIT, min_send_interval=0,
                    max_inflight_bytes=4 * 2**20) as kv:
            caches = {"small": filled(0.05, 1), "big": filled(1.5, 2), "huge": filled(6, 3)}
            before = {k: kv.stats()[k] for k in COUNTS}
            for n, batch in enumerate(BATCHES):
                for j, kind in enumerate(batch):
                    # Small saves use a key of their own in the batch: none
                    # replaces another, so each is written.
                    assert kv.save(FP, f"{kind}-{j}", caches[kind], [n]) is (kind != "huge")
                refused, small = batch.count("big"), batch.count("small")
                assert kv.flush(timeout=WAIT) is (refused == 0), (n, batch)
                after = {k: kv.stats()[k] for k in COUNTS}
                moved = {k: after[k] - before[k] for k in COUNTS}
                # A refusal is the daemon's (counted there and in this client,
                # whose flush reports it); a drop is save()'s own False, never
                # sent and never a flush's business.
                assert moved == {
                    "saves_received": small + refused, "saves_written": small,
                    "saves_superseded": 0, "saves_refused": refused, "saves_failed": 0,
                    "client_saves_sent": small + refused, "client_saves_refused": refused,
                    "client_saves_dropped": batch.count("huge"), "client_saves_lost": 0,
                    "client_saves_coalesced": 0,
                }, (n, batch, moved)
                before = after
                # Reported once: a flush with nothing handed off since says True.
                assert kv.flush(timeout=WAIT) is True, (n, batch)
    finally:
        assert rd.stop() == 0


def _flush_into(kv: Client, got: list[bool | BaseException]) -> None:
    try:
        got.append(kv.flush(timeout=WAIT))
    except Exception as exc:  # noqa: BLE001 - shown by the test's assert
        got.append(exc)


def _a_failure_behind_a_flush(kv: Client, save_behind: Callable[[], bool]) -> None:
    """A flush waits for a save being written slowly; another thread's save,
    handed off after the flush, fails meanwhile. That failure is the next
    flush's: the first said False and the next True, for a save never written."""
    assert kv.save(FP, "a", filled(60, 1), [1])  # about 1.8 s to write
    got: list[bool | BaseException] = []
    waiting = threading.Thread(target=_flush_into, args=(kv, got))
    waiting.start()
    time.sleep(0.5)  # the flush has queued its request
    assert save_behind()
    # The wait for a turn counts in the timeout: a timeout, not "daemon down".
    with pytest.raises(DaemonTimedOut, match="another flush of this client"):
        kv.flush(timeout=0.05)
    waiting.join(WAIT)
    assert got == [True]
    assert kv.flush(timeout=WAIT) is False
    assert kv.flush(timeout=WAIT) is True


def test_a_save_lost_in_the_client_after_a_flush_is_the_next_flushs(short_dir: Path) -> None:
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock, env={"KVKEEPER_TEST_FAULTS": "write_delay=0.03"})
    try:
        with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
            # Over 32 MiB of token ids: the I/O thread cannot build its header.
            _a_failure_behind_a_flush(kv, lambda: kv.save(FP, "b", filled(0.1, 2),
                                                          [1234567] * 5_000_000))
            assert kv.client_stats()["client_saves_lost"] == 1
        assert version_of(entry_path(root, "a")) == 1 and not entry_path(root, "b").exists()
    finally:
        assert stop_process(proc) == 0


def test_a_save_refused_after_a_flush_is_the_next_flushs(short_dir: Path) -> None:
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock, "--max-pending-bytes", "100M",
                         env={"KVKEEPER_TEST_FAULTS": "write_delay=0.03"})
    try:
        with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
            # No room beside the first: refused busy while the flush waits.
            _a_failure_behind_a_flush(kv, lambda: kv.save(FP, "b", filled(60, 2), [2]))
            assert kv.stats()["saves_refused"] == 1
        assert version_of(entry_path(root, "a")) == 1 and not entry_path(root, "b").exists()
    finally:
        assert stop_process(proc) == 0


def test_a_flush_answered_just_before_the_daemon_exits_is_true(
    short_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A daemon told to stop writes the save a flush waits for, answers the
    flush and closed its socket at once: a client that had not read the answer
    by then never could (its ZeroMQ socket drops what it has not read when the
    connection ends), so the flush failed, the daemon gone, though the save
    was written (and a later flush would have said False)."""
    from kvkeeper.daemon.faults import ENV

    caplog.set_level(logging.WARNING, logger="kvkeeper")
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    results = []
    for n in range(4):
        # 20 ms per MiB: the flush is read long before the 32 MiB save is written.
        proc = serve_process(root, sock, env={ENV: "write_delay=0.02"})
        kv = Client(sock, timeout=WAIT, min_send_interval=0)
        try:
            assert kv.connected
            assert kv.save(FP, f"last-{n}", filled(32, n + 1), [n + 1])
            got: list[bool | BaseException] = []
            t = threading.Thread(target=_flush_into, args=(kv, got))
            t.start()
            time.sleep(0.2)
            proc.send_signal(signal.SIGTERM)  # drains: the save is written, the flush answered
            # This thread keeps the GIL meanwhile (a generation loop busy in
            # Python), handing it over only every 0.05 s: the client's I/O
            # thread reads the answer up to about 0.1 s after it came (it may
            # wait its turn behind the flush thread too), well within the
            # daemon's 0.25 s.
            hog_until = time.monotonic() + 1.5
            interval = sys.getswitchinterval()
            sys.setswitchinterval(0.05)
            try:
                while time.monotonic() < hog_until:
                    pass
            finally:
                sys.setswitchinterval(interval)
            assert proc.wait(WAIT) == 0
            t.join(WAIT)
            assert not t.is_alive()
            results.append(got[0] if got else None)
        finally:
            kv.close(timeout=1)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert version_of(entry_path(root, f"last-{n}")) == n + 1
    assert results == [True] * 4, results
    assert not [r for r in caplog.records if "saves_unconfirmed" in r.getMessage()
                or "flush_unconfirmed" in r.getMessage()]


def test_a_flush_of_many_saves_is_answered_before_the_daemon_exits(short_dir: Path) -> None:
    """A flush waiting for 30 saves when the daemon is told to stop is
    answered True once the drain wrote them all, before the daemon closes
    its socket (before: the flush's task, a few turns of the event loop from
    answering, was cancelled with the rest, and the flush raised "the daemon
    went away" though every save was written and the daemon exited 0)."""
    from kvkeeper.daemon.faults import ENV

    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock, env={ENV: "write_delay=0.02"})
    try:
        with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
            for i in range(30):
                assert kv.save(FP, f"k{i}", filled(1, i + 1), [i + 1])
            wait_for(lambda: kv.stats()["saves_received"] == 30, "the daemon to take them")
            got: list[bool | BaseException] = []
            t = threading.Thread(target=_flush_into, args=(kv, got))
            t.start()
            time.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(WAIT) == 0
            t.join(WAIT)
            assert not t.is_alive()
            assert got == [True], got
        for i in range(30):
            assert version_of(entry_path(root, f"k{i}")) == i + 1
    finally:
        stop_process(proc, signal.SIGKILL)


def test_a_flush_cut_short_while_it_warns_leaves_the_verdict_to_the_next(
        short_dir: Path) -> None:
    """A flush interrupted (Ctrl-C) while it warns that saves sent to a
    daemon that was since restarted may be lost returns nothing; the next
    flush must say False for them, not take them as answered for."""

    class CtrlC(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "event=flush_unconfirmed" in record.getMessage():
                raise KeyboardInterrupt

    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock)
    try:
        with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
            assert kv.save(FP, "a", filled(1, 1), [1]) and kv.flush(WAIT) is True
            assert kv.save(FP, "a", filled(1, 2), [2])
            wait_for(lambda: kv.stats()["saves_received"] == 2, "the daemon to take it")
            stop_process(proc, signal.SIGKILL)
            wait_for(lambda: not kv.connected, "the client to see the daemon go")
            proc = serve_process(root, sock)
            wait_for(lambda: kv.connected, "the client to reconnect")
            logger, handler = logging.getLogger("kvkeeper.client"), CtrlC()
            logger.addHandler(handler)
            try:
                with pytest.raises(KeyboardInterrupt):
                    kv.flush(WAIT)
            finally:
                logger.removeHandler(handler)
            assert kv.flush(WAIT) is False
            assert kv.flush(WAIT) is True
    finally:
        assert stop_process(proc) == 0


def test_a_flush_cut_short_after_its_verdict_leaves_it_to_the_next(short_dir: Path) -> None:
    """A Ctrl-C that lands while the flush prunes its settled keys, after it
    has worked out that the drain failed a save, leaves the next flush to
    say False. (Before: the totals were stored first, and the next flush
    said True for the failed save.) The interrupt is raised by the dict the
    pruning reads, standing for a SIGINT at that instruction."""
    from kvkeeper.daemon.faults import ENV

    class CtrlCOnce(dict):  # type: ignore[type-arg]
        armed = True

        def items(self):  # type: ignore[no-untyped-def]
            if CtrlCOnce.armed:
                CtrlCOnce.armed = False
                raise KeyboardInterrupt
            return super().items()

    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    # The I/O error comes after the rename: the file is there, the save failed.
    proc = serve_process(root, sock, env={ENV: "write_delay=0.05,io_error=dir_fsync"})
    try:
        with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
            assert kv.save(FP, "k", filled(4, 2), [2])
            drain_past_the_notice(kv, proc, received=1)
            assert proc.wait(WAIT) == 0
            wait_for(lambda: not kv.connected, "the client to see the daemon go")
            proc = serve_process(root, sock)
            wait_for(lambda: kv.connected, "the client to reconnect")
            kv._unsettled = CtrlCOnce(kv._unsettled)
            with pytest.raises(KeyboardInterrupt):
                kv.flush(WAIT)
            assert kv.flush(WAIT) is False
            assert kv.flush(WAIT) is True
    finally:
        assert stop_process(proc) == 0


def test_a_save_zeromq_had_no_room_for_waits_and_is_still_replaced(short_dir: Path) -> None:
    """With ZeroMQ's send queue full of notices (the daemon stopped), a save
    none of which went waits at the head of the backlog, where a newer save
    of its key still replaces it, and goes once the daemon reads again.
    (Before: the two were both sent; before that, the first was lost.)"""
    from kvkeeper.client.channel import _SNDHWM
    from kvkeeper.protocol import messages as m

    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock, "--min-write-interval", "0")
    try:
        with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
            proc.send_signal(signal.SIGSTOP)
            used = m.Used(v=m.PROTOCOL_VERSION, model=FP, cache_id="x", ino=1)
            for _ in range(_SNDHWM + 20_000):
                kv._channel.notify(used)
            wait_for(lambda: not kv._channel._outbox, "the notices handed to ZeroMQ")
            assert kv.save(FP, "a", filled(1, 2), [2])
            time.sleep(0.5)  # the I/O thread tries it, and puts it back
            assert kv.save(FP, "a", filled(1, 3), [3])
            wait_for(lambda: kv.client_stats()["client_saves_coalesced"] == 1,
                     "the newer save to replace the older")
            assert kv.client_stats()["client_saves_sent"] == 0
            proc.send_signal(signal.SIGCONT)
            assert kv.flush(timeout=WAIT) is True
            assert version_of(entry_path(root, "a")) == 3
            # The reservation goes back when the I/O thread next sees ZeroMQ
            # done with the save: that may come after the daemon's answer.
            wait_for(lambda: kv.client_stats()["client_inflight_bytes"] == 0,
                     "the reservation given back")
            c = kv.client_stats()
            assert (c["client_saves_sent"], c["client_saves_lost"]) == (1, 0), c
    finally:
        proc.send_signal(signal.SIGCONT)
        stop_process(proc, signal.SIGKILL)


def _stale_until_a_flush(kv: Client, caplog: pytest.LogCaptureFixture, reason: str) -> None:
    """Loads of "k" get version 1, each saying it may be stale (``reason``),
    until a flush says False, which settles the key."""
    with caplog.at_level(logging.WARNING, logger="kvkeeper.client"):
        for _ in range(2):
            got = kv.load(FP, "k")
            assert got is not None and got.token_ids == [1]
        said = [r.getMessage() for r in caplog.records
                if "event=load_may_be_stale" in r.getMessage()]
        assert len(said) == 2 and f"reason={reason}" in said[0], said
        assert kv.flush(timeout=WAIT) is False  # it tells, and settles the key
        caplog.clear()
        got = kv.load(FP, "k")
        assert got is not None and got.token_ids == [1]
        assert not [r for r in caplog.records if "load_may_be_stale" in r.getMessage()]


@pytest.mark.parametrize("how", ["held", "half sent"])
def test_a_load_after_a_restart_that_took_its_save_says_it_may_be_stale(
        short_dir: Path, caplog: pytest.LogCaptureFixture, how: str) -> None:
    """The daemon read a save and held it (write interval), or had read half
    of it (stopped), and was killed; a new one answered the load of the key
    with the older file. The client took that as settling its save: no word,
    and every later load of the key read the older file directly, until a
    flush said False."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock, "--min-write-interval", "600")
    try:
        with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
            assert kv.save(FP, "k", filled(0.1, 1), [1]) and kv.flush(timeout=WAIT)
            if how == "held":
                assert kv.save(FP, "k", filled(0.1, 2), [2])  # held by the daemon
                kv.ping()  # which has read it
            else:
                proc.send_signal(signal.SIGSTOP)  # it reads no more
                assert kv.save(FP, "k", filled(96, 2), [2])
                _wait_until_part_sent(kv)  # what ZeroMQ's buffers take of it
            stop_process(proc, signal.SIGKILL)
            wait_for(lambda: not kv.connected, "the client to see the daemon go")
            proc = serve_process(root, sock)
            wait_for(lambda: kv.connected, "the client to reconnect")
            _stale_until_a_flush(kv, caplog, "daemon_restarted" if how == "held" else "save_lost")
    finally:
        assert stop_process(proc) == 0


def test_a_load_after_a_refused_save_of_its_key_says_it_may_be_stale(
        short_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The daemon refused the key's last save (over its disk budget) and
    answered the load with the older file: the client took that as settling
    its save, with no word, and every later load read the older file
    directly, until a flush said False."""
    d = start_daemon(short_dir / "root", short_dir / "kv.sock", max_disk_bytes=2 * 2**20)
    try:
        with Client(d.socket, timeout=WAIT, min_send_interval=0) as kv:
            assert kv.save(FP, "k", filled(0.1, 1), [1]) and kv.flush(timeout=WAIT)
            assert kv.save(FP, "k", filled(3, 2), [2])  # refused: over the disk budget
            _stale_until_a_flush(kv, caplog, "save_refused")
            # Another key's refusal says nothing of this one's save.
            assert kv.save(FP, "other", filled(3, 4), [4])
            assert kv.save(FP, "k", filled(0.1, 3), [3])
            with caplog.at_level(logging.WARNING, logger="kvkeeper.client"):
                got = kv.load(FP, "k")
            assert got is not None and got.token_ids == [3]
            said = [r.getMessage() for r in caplog.records]
            assert not [line for line in said if "load_may_be_stale" in line], said
    finally:
        assert d.stop() == 0


def test_a_refusal_taken_in_during_a_flush_it_does_not_cover_still_warns(
        short_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A flush answered after the refusal of a save sent after it (the
    daemon refuses at once, and answers the flush once the save before it is
    written) forgot that refusal: the flush said True, and a load of the
    refused key returned the older file with no word."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock, "--max-disk-bytes", "4M")
    try:
        with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
            assert kv.save(FP, "k", filled(0.1, 1), [1]) and kv.flush(timeout=WAIT)
            proc.send_signal(signal.SIGSTOP)  # reads nothing until the flush is asked
            assert kv.save(FP, "a", filled(1.5, 1), [1])
            flushed: list[bool] = []
            t = threading.Thread(target=lambda: flushed.append(kv.flush(timeout=WAIT)))
            t.start()
            # The flush's request queued, after a's save (a fixed 0.5 s stood
            # for it: a flush thread late to start covered k too).
            ch = kv._channel

            def flush_queued() -> bool:
                with ch._lock:
                    return any(r.sent or r in ch._outbox for r in ch._waiting.values())

            wait_for(flush_queued, "the flush's request to be queued")
            assert kv.save(FP, "k", filled(5, 2), [2])  # refused: over the disk budget
            time.sleep(0.3)
            proc.send_signal(signal.SIGCONT)
            t.join(WAIT)
            assert flushed == [True]  # it covers a's save, not k's
            with caplog.at_level(logging.WARNING, logger="kvkeeper.client"):
                got = kv.load(FP, "k")
            assert got is not None and got.token_ids == [1]
            said = [r.getMessage() for r in caplog.records if "load_may_be_stale" in r.getMessage()]
            assert len(said) == 1 and "reason=save_refused" in said[0], caplog.text
    finally:
        proc.send_signal(signal.SIGCONT)
        assert stop_process(proc) == 0
