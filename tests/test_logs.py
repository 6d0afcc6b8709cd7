"""Every log line is one line of key=value fields, whatever ids, paths and
reasons it carries."""
from __future__ import annotations

import contextlib
import logging
import re
import shlex
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvkeeper.client.client import Client

from .conftest import WAIT, daemon_log, serve_process, stop_process
from .faultkit import FP, entry_path, filled

#: An id a client may use: a newline that would start a forged line, spaces,
#: quotes, "=" and a backslash.
NASTY = 'v\nts=0 level=ERROR event=forged "x"=y \\ z'


def _fields(line: str) -> dict[str, str]:
    """A logfmt line split by a reader that knows nothing of kvkeeper: shell
    quoting rules match logfmt's for what kvkeeper writes (backslash escapes
    inside double quotes; \\n stays two characters)."""
    return dict(tok.split("=", 1) for tok in shlex.split(line, posix=True) if "=" in tok)


def test_ids_and_reasons_stay_inside_their_field(short_dir: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock, "--log-level", "info")
    try:
        with Client(sock, timeout=WAIT) as kv:
            assert kv.save(FP, NASTY, filled(0.25, 1), [1]) and kv.flush(timeout=WAIT)
            path = entry_path(root, NASTY)
            path.write_bytes(path.read_bytes()[:100])  # damaged: the client logs, the daemon moves it
            caplog.set_level(logging.INFO, logger="kvkeeper")
            assert kv.load(FP, NASTY) is None
            kv.ping()
    finally:
        assert stop_process(proc) == 0
    client_lines = [r.getMessage() for r in caplog.records if "event=load_miss" in r.getMessage()]
    assert len(client_lines) == 1 and "\n" not in client_lines[0]
    fields = _fields(client_lines[0])
    assert fields["event"] == "load_miss" and fields["id"] == NASTY.replace("\n", "\\n")
    assert set(fields) == {"event", "model", "id", "reason"}  # nothing spilled out of a value
    assert fields["model"] == FP and "header length" in fields["reason"]
    said = daemon_log(proc)
    assert "event=forged" not in "\n".join(
        ln for ln in said.splitlines() if not ln.startswith("ts=")), said
    moved = [ln for ln in said.splitlines() if "event=quarantined" in ln]
    assert len(moved) == 1, said
    fields = _fields(moved[0])
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}", fields["ts"]), fields["ts"]
    assert set(fields) == {"ts", "level", "logger", "event", "model", "id", "reason", "moved_to"}
    assert fields["level"] == "WARNING" and fields["event"] == "quarantined"
    assert fields["id"] == NASTY.replace("\n", "\\n")
    assert Path(fields["moved_to"]).parent == root / "quarantine"


def test_a_refused_save_is_logged_with_its_key(short_dir: Path) -> None:
    """`event=save_refused` named the code and the reason only: a flush that
    said False could be traced to its key only by the time of the line (a
    chaos run's complaint)."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock, "--log-level", "info", "--max-disk-bytes", "1M")
    try:
        with Client(sock, timeout=WAIT) as kv:
            assert kv.save(FP, NASTY, filled(2, 1), [1])  # over the disk budget
            assert kv.flush(timeout=WAIT) is False
    finally:
        assert stop_process(proc) == 0
    lines = [ln for ln in daemon_log(proc).splitlines()
             if "event=save_refused" in ln]
    assert len(lines) == 1, lines
    fields = _fields(lines[0])
    assert set(fields) == {"ts", "level", "logger", "event", "code", "model", "id", "reason"}
    assert (fields["code"], fields["model"], fields["id"]) == \
        ("too_large", FP, NASTY.replace("\n", "\\n"))


def test_a_delete_is_logged_with_its_key(short_dir: Path) -> None:
    """A delete (rm, Client.delete) left no line at any level: the log could
    not say why a conversation's cache was gone (an operator's review)."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock, "--min-write-interval", "30")
    try:
        with Client(sock, timeout=WAIT) as kv:
            assert kv.save(FP, NASTY, filled(0.25, 1), [1]) and kv.flush(timeout=WAIT)
            assert kv.delete(FP, NASTY)
            assert not kv.delete(FP, "never-saved")  # nothing gone: nothing said
            # Held by --min-write-interval (the first save of a key is written
            # at once), the second save is discarded by the delete.
            assert kv.save(FP, "held", filled(0.25, 1), [1]) and kv.flush(timeout=WAIT)
            assert kv.save(FP, "held", filled(0.25, 2), [1, 2])
            assert kv.delete(FP, "held")
            assert kv.load(FP, "held") is None
            # Counted apart, as loads are (before: "deletes" 3, with nothing
            # deleted by the one of a key never saved).
            stats = kv.stats()
            assert (stats["deletes"], stats["deletes_missing"]) == (2, 1), stats
    finally:
        assert stop_process(proc) == 0
    lines = [_fields(ln) for ln in daemon_log(proc).splitlines()
             if "event=deleted" in ln]
    assert [(f["level"], f["model"], f["id"], f["file_deleted"], f["pending_save_discarded"])
            for f in lines] == [("INFO", FP, NASTY.replace("\n", "\\n"), "true", "false"),
                                ("INFO", FP, "held", "true", "true")], lines


def test_every_line_of_the_daemons_log_is_one_event(short_dir: Path) -> None:
    """The start-up banner was plain text, another library's lines (asyncio's
    at debug) had no event, and a traceback was lines of its own: a logfmt
    reader could not split them (an operator's review)."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock, "--log-level", "debug")
    try:
        with Client(sock, timeout=WAIT) as kv:
            assert kv.save(FP, "a", filled(0.25, 1), [1]) and kv.flush(timeout=WAIT)
            shutil.rmtree(root / "sessions")  # an event that ends with a sentence
            assert kv.save(FP, "a", filled(0.25, 2), [1]) and kv.flush(timeout=WAIT)
            assert kv.delete(FP, "a")
    finally:
        assert stop_process(proc) == 0
    lines = daemon_log(proc).splitlines()
    events = [_fields(ln) for ln in lines]
    assert all(ln.startswith("ts=") and {"ts", "level", "logger", "event"} <= set(f)
               for ln, f in zip(lines, events, strict=True)), lines
    import kvkeeper

    (start,) = [f for f in events if f["event"] == "starting"]
    assert (start["version"], start["socket"], start["root"]) == (
        kvkeeper.__version__, str(sock), str(root)), start
    assert any(f["logger"] == "asyncio" and f["event"] == "message" and "selector" in f["text"]
               for f in events), lines
    # What an event says in words is a field of its own, after the others.
    (cleared,) = [f for f in events if f["event"] == "sessions_recreated"]
    assert cleared == {"ts": cleared["ts"], "level": "WARNING", "logger": "kvkeeper.store",
                       "event": "sessions_recreated", "path": str(root / "sessions"),
                       "msg": "the store was cleared while the daemon ran"}, cleared


def test_a_traceback_stays_inside_its_line() -> None:
    from kvkeeper.logs import LogfmtFormatter, get_logger

    try:
        1 / 0  # noqa: B018
    except ZeroDivisionError:
        import sys

        record = get_logger("kvkeeper.test").makeRecord(
            "kvkeeper.test", logging.ERROR, __file__, 1, "event=job_crashed key=%s",
            ("a b",), sys.exc_info())
    for f in get_logger("kvkeeper.test").filters:
        f.filter(record)
    line = LogfmtFormatter().format(record)
    assert "\n" not in line, line
    fields = _fields(line)
    assert (fields["event"], fields["key"]) == ("job_crashed", "a b")
    assert fields["traceback"].startswith("Traceback") and "ZeroDivisionError" in fields["traceback"]


def test_every_log_template_is_an_event_with_fields() -> None:
    """Each message kvkeeper logs is ``event=name key=%s ...``, with at most a
    sentence after a colon: eight ended in text in parentheses or after a
    semicolon, which a logfmt reader took for keys (an operator's review)."""
    import ast

    import kvkeeper

    field = r"[a-z_0-9]+=(?:%[-.0-9]*[sdfg]|[a-z_0-9]+)"
    form = re.compile(rf"event=(?:%s|[a-z_0-9]+)(?: {field})*(?:: .+)?", re.S)
    bad = []
    for path in Path(kvkeeper.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("debug", "info", "warning", "error", "exception")
                    and node.args and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)
                    and not form.fullmatch(node.args[0].value)):
                bad.append(f"{path.name}:{node.lineno}: {node.args[0].value}")
    assert not bad, bad


def test_a_log_nobody_reads_does_not_stop_the_daemon(short_dir: Path) -> None:
    """stderr a pipe whose reader stays but does not read (`kvkeeper serve
    2>&1 | less`, the pager paused): once the pipe was full, each log line
    blocked the daemon's event loop: flushes timed out and SIGTERM did
    nothing until the pipe was read. Lines past those waiting are dropped."""
    import fcntl
    import os
    import signal
    import subprocess
    import sys

    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)  # full after some 30 lines
    proc = subprocess.Popen([sys.executable, "-m", "kvkeeper.cli", "serve", "--root", str(root),
                             "--socket", str(sock), "--log-level", "debug"],
                            stdout=subprocess.DEVNULL, stderr=write_end)
    os.close(write_end)
    try:
        with Client(sock, timeout=WAIT, connect_timeout=WAIT, min_send_interval=0) as kv:
            for i in range(80):  # each written and logged: some 12 KB of log
                assert kv.save(FP, f"k{i % 4}", filled(0.01, i + 1), [i])
                assert kv.flush(timeout=10), i
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(read_end)
    assert entry_path(root, "k3").exists()


def _who_writes(fd: int, answer: str, text: str, before: Callable[[], None] = lambda: None
                ) -> str:
    """Which thread writes the log line ``text`` of a BehindHandler on a
    stream of descriptor ``fd`` whose poll answers ``answer`` (macOS's
    answers are simulated: Linux polls a terminal); ``before`` runs once the
    handler is made."""
    import select
    import threading

    from kvkeeper.logs import BehindHandler

    by: list[str] = []
    written = threading.Event()

    class Stream:
        encoding, errors = "utf-8", "backslashreplace"

        def fileno(self) -> int:
            return fd

        def write(self, line: str) -> int:
            by.append(threading.current_thread().name)
            written.set()
            return len(line)

        def flush(self) -> None:
            pass

    class Polled:
        def poll(self, timeout: int) -> list[tuple[int, int]]:
            return [(fd, getattr(select, answer))]

    handler = BehindHandler(Stream())  # type: ignore[arg-type]
    handler._poll = Polled()  # type: ignore[assignment]
    try:
        before()
        handler.emit(logging.LogRecord("kvkeeper.test", logging.INFO, __file__, 0, text, (),
                                       None))
        assert written.wait(WAIT)
    finally:
        handler.close()
    assert len(by) == 1, by
    return "direct" if by[0] == threading.current_thread().name else "behind"


@pytest.mark.parametrize(("device", "answer", "full", "size", "direct"), [
    ("pipe", "POLLOUT", False, 8, True),
    ("pipe", "POLLOUT", False, "PIPE_BUF-100", True),
    ("pipe", "POLLOUT", False, "PIPE_BUF+100", False),
    # 1013 characters no encoding has: 6078 bytes as the stream writes them
    # (backslashreplace), counted as at most 4 bytes a character before.
    ("pipe", "POLLOUT", False, -1013, False),
    ("pipe", "POLLNVAL", True, 8, False),  # select: no room
    ("terminal", "POLLNVAL", False, 8, True),
    ("terminal", "POLLNVAL", False, 900, False),
    ("terminal", "POLLNVAL", False, -150, False),  # 900 bytes, counted as 150 before
    # A Linux pty's poll says "room" with about 257 bytes left (a 2 KB
    # line written at once blocked on a stalled terminal).
    ("terminal", "POLLOUT", False, 300, False),
])
def test_a_line_is_written_at_once_only_where_there_is_room(
        device: str, answer: str, full: bool, size: int | str, direct: bool) -> None:
    """A line goes out at once only when the stream is sure to take all of
    it; otherwise it goes behind (to the log's thread), so a reader that
    stalls never holds up the daemon. macOS's poll answers POLLNVAL for a
    terminal (it "does not support devices"): any answer was taken for
    room, and a stalled terminal froze the daemon; select is asked then.
    How much "room" holds depends on the device (see logs._DIRECT_MAX).
    (macOS's answers are simulated: Linux polls a terminal.)"""
    import fcntl
    import os
    import pty
    import select

    if isinstance(size, str):  # this system's PIPE_BUF (4096 on Linux, 512 on macOS)
        size = select.PIPE_BUF + int(size.removeprefix("PIPE_BUF"))
    if device == "pipe":
        read_end, write_end = os.pipe()
    else:
        read_end, write_end = pty.openpty()
    if full:
        fcntl.fcntl(write_end, fcntl.F_SETFL, os.O_NONBLOCK)
        with contextlib.suppress(BlockingIOError):
            while True:
                os.write(write_end, b"x" * 65536)
    text = "event=x " + ("y" * size if size > 0 else "\udce9" * -size)
    try:
        assert _who_writes(write_end, answer, text) == ("direct" if direct else "behind")
    finally:
        os.close(read_end)
        os.close(write_end)


def test_the_room_a_line_needs_follows_the_descriptor_where_it_points_now(
        tmp_path: Path) -> None:
    """The device's kind was fixed when the handler was made: stderr a file
    then (4 KiB at once), pointed at a terminal later (dup2), a 2000-byte
    line was written at once and blocked on a stalled terminal."""
    import os
    import pty

    fd = os.open(tmp_path / "log", os.O_WRONLY | os.O_CREAT, 0o600)
    master, slave = pty.openpty()
    try:
        # Room, as a pty's poll says with 257 bytes left.
        assert _who_writes(fd, "POLLOUT", "event=x " + "y" * 2000,
                           before=lambda: os.dup2(slave, fd)) == "behind"
    finally:
        for d in (fd, master, slave):
            os.close(d)


def _behind_a_stuck_reader() -> tuple[Any, list[str], Any]:
    """A BehindHandler (5 lines waiting at most, messages alone) on a reader
    that reads nothing until the gate is set; what it read, in ``out``."""
    import threading

    from kvkeeper.logs import BehindHandler

    gate = threading.Event()
    out: list[str] = []

    class Stuck:
        def write(self, text: str) -> int:
            assert gate.wait(WAIT)
            out.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    handler = BehindHandler(Stuck(), limit=5)  # type: ignore[arg-type]
    handler.setFormatter(logging.Formatter("%(message)s"))
    return gate, out, handler


def test_dropped_log_lines_are_counted_where_they_were_dropped() -> None:
    """A log read too slowly: the lines past those waiting are dropped, and
    one line in their place says how many, so that every line is written
    or counted. (The first version said so after the next line written,
    before lines queued earlier: after nearly every line, in the wrong
    place.)"""
    gate, out, handler = _behind_a_stuck_reader()
    log = logging.getLogger("kvkeeper.test_behind")
    log.propagate, level = False, log.level
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    try:
        for i in range(20):
            log.info("line=%d", i)
        gate.set()
        deadline = time.monotonic() + WAIT
        while len(out) < 5:  # what waited is written
            assert time.monotonic() < deadline, out
            time.sleep(0.01)
        for i in range(20, 23):
            log.info("line=%d", i)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        handler.close()
        handler.close()  # logging's shutdown closes it again: once is enough
    lines = "".join(out).splitlines()
    written = [int(ln.split("=")[1]) for ln in lines if ln.startswith("line=")]
    (notice,) = [ln for ln in lines if "event=log_lines_dropped" in ln]
    kept = written.index(20)
    assert written[:kept] == list(range(kept)) and written[kept:] == [20, 21, 22], lines
    assert lines.index(notice) == kept  # just before the first line after the gap
    assert int(notice.split("count=")[1].split()[0]) + kept == 20  # every line written or counted


_UNREAD_STDERR = """
import logging, sys
from kvkeeper.logs import BehindHandler

logging.basicConfig(level=logging.INFO, handlers=[BehindHandler(sys.stderr)])
for i in range(200):
    logging.getLogger("kvkeeper.test").info("event=line n=%d pad=%s", i, "x" * 1000)
"""


def test_a_process_whose_stderr_nobody_reads_still_exits(short_dir: Path) -> None:
    """stderr a FIFO whose reader holds it open and never reads, Python's
    stderr buffered (no PYTHONUNBUFFERED, as users run it): the log thread
    blocked in a write holding the stream's buffer lock, and at exit the
    interpreter's flush of stderr waited for that lock for ever (a daemon
    drained on SIGTERM and never exited). The handler gives up its lines
    after 2 s, and the process ends."""
    import os
    import subprocess
    import sys

    fifo = short_dir / "err"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # held open, never read
    try:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
        with open(fifo, "wb") as err:
            proc = subprocess.Popen([sys.executable, "-c", _UNREAD_STDERR],
                                    stdout=subprocess.DEVNULL, stderr=err, env=env)
        try:
            assert proc.wait(WAIT) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    finally:
        os.close(reader)


def test_lines_dropped_just_before_the_close_are_still_counted() -> None:
    """Lines dropped (a log read too slowly) were counted only before a
    later line: a burst just before the close (an exit) lost 179 of 200
    lines with no word of it."""
    gate, out, handler = _behind_a_stuck_reader()
    for i in range(20):
        handler.handle(logging.LogRecord("kvkeeper.test", logging.INFO, __file__, 0,
                                         "line=%d", (i,), None))
    gate.set()
    handler.close(timeout=WAIT)
    lines = "".join(out).splitlines()
    written = [ln for ln in lines if ln.startswith("line=")]
    (notice,) = [ln for ln in lines if "event=log_lines_dropped" in ln]
    assert int(re.search(r"count=(\d+)", notice).group(1)) + len(written) == 20, lines  # type: ignore[union-attr]


def test_a_line_on_a_non_blocking_descriptor_is_written_whole() -> None:
    """stderr a pipe another process made non-blocking, with little room: a
    long line was cut where the pipe was full, and the next line went on
    after the torn one (two records on one line)."""
    import fcntl
    import os
    import threading

    from kvkeeper.logs import BehindHandler

    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)
    os.set_blocking(w, False)
    stream = open(w, "w", encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
    handler = BehindHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    long = "event=long pad=" + "x" * 10_000
    try:
        for text in (long, "event=next"):
            handler.handle(logging.LogRecord("kvkeeper.test", logging.INFO, __file__, 0, text,
                                             (), None))
        got = bytearray()

        def read() -> None:
            while not got.endswith(b"event=next\n"):
                got.extend(os.read(r, 65536))
                time.sleep(0.01)  # slowly: the writer meets a full pipe again

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(WAIT)
        assert not reader.is_alive(), bytes(got[-200:])
    finally:
        handler.close(timeout=WAIT)
        stream.close()
        os.close(w)
        os.close(r)
    assert got.decode().splitlines() == [long, "event=next"]


def test_a_line_written_at_once_never_waits_on_a_full_non_blocking_terminal() -> None:
    """A non-blocking terminal nobody reads: a terminal's write takes part
    of a line when its room is short (less than poll promised), and the
    logging thread (the daemon's event loop) then waited for room that never
    came. What is left goes to the writer thread instead."""
    import os
    import pty
    import threading

    from kvkeeper.logs import BehindHandler

    master, slave = pty.openpty()
    os.set_blocking(slave, False)
    stream = open(slave, "w", encoding="utf-8", errors="backslashreplace",  # noqa: SIM115
                  closefd=False)
    handler = BehindHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    done = threading.Event()

    def log_many() -> None:
        for i in range(400):  # never read: the terminal fills
            handler.handle(logging.LogRecord("kvkeeper.test", logging.INFO, __file__, 0,
                                             "event=line n=%d pad=%s", (i, "x" * 200), None))
        done.set()

    try:
        logger = threading.Thread(target=log_many, daemon=True)
        logger.start()
        assert done.wait(WAIT), "a log call waited for the terminal"
    finally:
        # The terminal's end closed first: a call still waiting gets an
        # error, and lets go of the handler's lock for its close.
        os.close(master)
        logger.join(WAIT)
        handler.close(timeout=0.1)
        stream.close()
        os.close(slave)
