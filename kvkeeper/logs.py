"""kvkeeper's loggers: every line stays one ``key=value`` line.

Log messages are written ``event=... key=%s``; the values come from users
(cache ids, paths, reasons with spaces). A value with a space, a quote or an
``=`` is quoted, and control characters are escaped, so a log reader can split
a line into its fields and a cache id holding a newline cannot forge a line.
"""

from __future__ import annotations

import io
import logging
import numbers
import os
import queue
import re
import select
import stat
import sys
import threading
from typing import TextIO

__all__ = ["BehindHandler", "LogfmtFormatter", "get_logger", "logfmt_value"]

#: Characters escaped inside quotes: quotes, backslash, and every control
#: character (C0, DEL, C1) and Unicode line or paragraph separator.
_ESCAPED_SET = r'"\\\x00-\x1f\x7f-\x9f\u2028\u2029'
_ESCAPED = re.compile(f"[{_ESCAPED_SET}]")
#: Characters that force quoting: those, whitespace and "=".
_NEEDS_QUOTES = re.compile(rf"[\s={_ESCAPED_SET}]")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def logfmt_value(text: str) -> str:
    """``text`` as a logfmt value: as it is when it needs nothing, else in
    double quotes with quotes, backslashes and control characters escaped;
    the empty string is ``""``."""
    if text and not _NEEDS_QUOTES.search(text):
        return text
    return '"' + _ESCAPED.sub(_escape, text) + '"'


def _escape(match: re.Match[str]) -> str:
    ch = match.group()
    return _ESCAPES.get(ch) or f"\\u{ord(ch):04x}"


#: A conversion of a %-format ("%s", "%d", "%.1f"), or "%%".
_CONVERSION = re.compile(r"%(?:%|[-#0 +]*[0-9]*(?:\.[0-9]+)?[diouxXeEfFgGcrsa])")


class _Values(logging.Filter):
    """Makes every argument of a record that is not a number a logfmt value,
    and the sentence an event ends with after ": " a field of its own
    (``msg="..."``): left as words after the fields, a logfmt reader took
    them for keys, and the colon for the end of the last value."""

    def filter(self, record: logging.LogRecord) -> bool:
        raw = record.args if isinstance(record.args, tuple) else ()
        # Numbers of any kind (numpy's too) stay numbers for %d and %.1f.
        quoted = tuple(a if a is None or isinstance(a, numbers.Number) else logfmt_value(str(a))
                       for a in raw)
        if raw:
            record.args = quoted
        head, colon, sentence = str(record.msg).partition(": ")
        if colon and head.startswith("event=") and "=" not in sentence.split(" ", 1)[0]:
            n = sum(c != "%%" for c in _CONVERSION.findall(head))
            try:
                # Its own arguments as they are: the sentence is quoted whole.
                text = sentence % raw[n:] if raw else sentence
            except (TypeError, ValueError, KeyError):
                return True  # a template that does not fit its arguments: as it came
            record.msg, record.args = head + " msg=%s", (*quoted[:n], logfmt_value(text))
        return True


_FILTER = _Values()


def get_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` with the values of its records made logfmt
    values (once per logger, however often it is asked for)."""
    log = logging.getLogger(name)
    if _FILTER not in log.filters:
        log.addFilter(_FILTER)
    return log


class LogfmtFormatter(logging.Formatter):
    """``ts=... level=... logger=... event=...``: one line per record, every
    record's. A message that is no event (another library's: asyncio's
    "Using selector" at debug) becomes ``event=message text="..."``, and a
    traceback goes into a ``traceback`` field, its newlines escaped: appended
    as lines of its own, it was text no logfmt reader could tell from the
    next event."""

    def __init__(self) -> None:
        # One field: "2026-12-01 21:40:00,123" would be two.
        super().__init__("ts=%(asctime)s.%(msecs)03d level=%(levelname)s logger=%(name)s "
                         "%(message)s", datefmt="%Y-%m-%dT%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if not message.startswith("event="):
            message = "event=message text=" + logfmt_value(message)
        record.message = message
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        line = self.formatMessage(record)
        if record.exc_info:
            record.exc_text = record.exc_text or self.formatException(record.exc_info)
        extra = [text for text in (record.exc_text, record.stack_info and
                                   self.formatStack(record.stack_info)) if text]
        if extra:
            line += " traceback=" + logfmt_value("\n".join(extra))
        return line


#: The longest line (in bytes, its newline included) written at once when
#: poll or select says the stream has room, by what that room guarantees: a
#: file takes any write; a pipe one of PIPE_BUF whole, unblocked (512 bytes
#: on macOS and the BSDs, whose poll says "room" from there; 4096 on
#: Linux); a terminal only what lies under its high-water mark (a Linux pty
#: said "room" with about 257 bytes left; a BSD terminal's select, from its
#: low-water mark, about 1 KiB under). Longer lines go behind.
_DIRECT_MAX = {"file": 4096, "pipe": select.PIPE_BUF,
               "terminal": 256 if sys.platform.startswith("linux") else 512}


def _room_kind(stream: TextIO) -> str:
    """What ``stream``'s descriptor is, for ``_DIRECT_MAX``: a regular file,
    a terminal, or (a pipe, a socket) a pipe."""
    try:
        fd = stream.fileno()
        if os.isatty(fd):
            return "terminal"
        return "file" if stat.S_ISREG(os.fstat(fd).st_mode) else "pipe"
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return "pipe"


class BehindHandler(logging.Handler):
    """Writes each line to ``stream`` at once when it can take it without
    waiting (the line is out before the next step: a kill right after an
    eviction must not hide its line), and otherwise hands it to a thread of
    its own: the daemon never waits for its log. Written from the event
    loop, a stderr pipe nobody read (``kvkeeper serve 2>&1 | less``, paused)
    froze the daemon, SIGTERM included. Past ``limit`` lines waiting, lines
    are dropped; a line saying how many (``event=log_lines_dropped``) takes
    their place once there is room. A failing stream (a full disk, a pipe
    whose reader is gone) loses its lines and nothing else. The thread
    starts with the first line it is handed, from the thread that logs it:
    it inherits that thread's scheduling policy (the daemon's are
    SCHED_BATCH)."""

    def __init__(self, stream: TextIO, limit: int = 10_000) -> None:
        super().__init__()
        self._stream = stream
        self._limit = limit
        # Lines, or what a direct write left of one (bytes, see emit).
        self._lines: queue.Queue[str | bytes | None] = queue.Queue()
        self._dropped = 0
        self._writer: threading.Thread | None = None
        self._closed = False
        # Lines handed to the writer and not yet written: while there are
        # any, a new line queues behind them (in order); while there are
        # none, the writer is not writing, and a direct write cannot mix
        # with one of its. (Never held during a write: a stuck one would
        # hold up every line after it, the event loop's too.)
        self._behind = 0
        self._count = threading.Lock()
        try:
            self._poll: select.poll | None = select.poll()
            self._poll.register(stream.fileno(), select.POLLOUT)
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            self._poll = None  # no descriptor to ask (or no poll): always behind
        # A text file's lines go to its descriptor itself (see _put_out), in
        # its encoding; another stream's through its write().
        try:
            self._fd: int | None = stream.fileno() if isinstance(stream, io.TextIOWrapper) \
                else None
        except (OSError, ValueError, io.UnsupportedOperation):
            self._fd = None
        self._encoding = getattr(stream, "encoding", None) or "utf-8"
        self._errors = getattr(stream, "errors", None) or "backslashreplace"

    def emit(self, record: logging.LogRecord) -> None:
        # (Handler.handle holds self.lock: one emit at a time. Only emit and
        # close put lines; the writer only takes them.)
        if self._closed:
            return
        try:
            line = self.format(record)
        except Exception:  # noqa: BLE001 - as logging's own handlers do
            self.handleError(record)
            return
        with self._count:
            idle = self._behind == 0
        rest: bytes | None = None
        if idle and not self._dropped and self._can_take(line):
            rest = self._put_out(line, wait=False)
            if not rest:
                return
        if self._writer is None:
            self._writer = threading.Thread(target=self._write, name="kvkeeper-log",
                                            daemon=True)
            self._writer.start()
        if rest:
            # A non-blocking descriptor took part of it, or none (a terminal's
            # room was less than poll said): the writer writes the rest, now
            # idle, so in order (waiting here held up the event loop).
            self._hand(rest)
            return
        if self._dropped:
            if self._lines.qsize() + 2 > self._limit:
                self._dropped += 1
                return
            self._hand(self._dropped_notice())
            self._dropped = 0
        if self._lines.qsize() >= self._limit:
            self._dropped += 1
            return
        self._hand(line)

    def _dropped_notice(self) -> str:
        notice = logging.LogRecord(
            "kvkeeper.logs", logging.WARNING, __file__, 0,
            "event=log_lines_dropped count=%d: lines here were not written, the log "
            "was not read fast enough", (self._dropped,), None)
        _FILTER.filter(notice)
        return self.format(notice)

    def _can_take(self, line: str) -> bool:
        # In bytes as written: an undecodable character of a path is one
        # character and a 6-byte escape (len*4 let a 6 KB line block).
        # The kind asked each time: the descriptor may have been pointed
        # elsewhere since (dup2), and poll asks what it is now.
        if self._poll is None or self._bytes_out(line) >= _DIRECT_MAX[_room_kind(self._stream)]:
            return False
        answer = self._poll.poll(0)
        if any(events & select.POLLNVAL for _, events in answer):
            # macOS's poll "does not support devices": a terminal, /dev/null.
            # Taken for room, a stalled terminal froze the daemon; taken for
            # none, every line went behind, after what serve prints itself.
            # select asks such a device (see _DIRECT_MAX for how much its
            # "room" holds).
            try:
                return bool(select.select([], [self._stream.fileno()], [], 0)[1])
            except (OSError, ValueError):  # past FD_SETSIZE, say
                return False
        return any(events & select.POLLOUT for _, events in answer)

    def _bytes_out(self, line: str) -> int:
        """How many bytes ``line`` becomes on the stream (its own encoding
        and error handler: an undecodable character of a path, one here,
        goes out as a 6-byte escape)."""
        try:
            return len(line.encode(getattr(self._stream, "encoding", None) or "utf-8",
                                   getattr(self._stream, "errors", None) or "strict"))
        except (LookupError, UnicodeError):
            return len(line) * 6  # what it becomes cannot be told: as long as it can be

    def _hand(self, line: str | bytes) -> None:
        with self._count:
            self._behind += 1
        self._lines.put(line)

    def _put_out(self, line: str | bytes, wait: bool = True) -> bytes | None:
        """Write ``line`` (bytes: what a direct write left of one). With
        ``wait`` False, what a non-blocking descriptor did not take is
        returned (for the writer) instead of waited for; else None."""
        try:
            if self._fd is None:
                assert isinstance(line, str)  # (bytes come of the descriptor's writes)
                self._stream.write(line + "\n")
                self._stream.flush()
                return None
            # Not through the stream: its buffer's lock was held for the
            # whole blocking write, and at exit the interpreter's flush of
            # stderr waited for that lock for ever: a daemon whose stderr
            # pipe nobody read never exited after its drain (a review;
            # unseen with PYTHONUNBUFFERED, whose stderr has no buffer).
            out = memoryview(line if isinstance(line, bytes)
                             else (line + "\n").encode(self._encoding, self._errors))
            while out:
                try:
                    out = out[os.write(self._fd, out):]
                except BlockingIOError:
                    # A descriptor another process made non-blocking: the
                    # rest of the line waits for room (cut there, the next
                    # line went on after a torn one: a review).
                    if not wait:
                        return bytes(out)
                    select.select([], [self._fd], [], 1.0)
        except Exception:  # noqa: BLE001, S110 - no log to say it in; the daemon goes on
            pass
        return None

    def _write(self) -> None:
        while (line := self._lines.get()) is not None:
            self._put_out(line)
            with self._count:
                self._behind -= 1

    def close(self, timeout: float = 2.0) -> None:
        """Write what waits, for at most ``timeout`` seconds (a stream that
        is not read keeps the rest), and stop the writer. Once: logging's
        own shutdown at exit calls it again."""
        with self.lock:  # type: ignore[union-attr]
            if self._closed:
                return
            self._closed = True
            if self._dropped:
                # Told only before a later line, it was lost when none came
                # (a burst just before exit: 179 of 200 lines gone, no word).
                self._hand(self._dropped_notice())
            self._lines.put(None)
        if self._writer is not None:
            self._writer.join(timeout)
        super().close()
