"""kvkeeper's loggers: every line stays one ``key=value`` line.

Log messages are written ``event=... key=%s``; the values come from users
(cache ids, paths, reasons with spaces). A value with a space, a quote or an
``=`` is quoted, and control characters are escaped, so a log reader can split
a line into its fields and a cache id holding a newline cannot forge a line.
"""

from __future__ import annotations

import logging
import numbers
import re

__all__ = ["get_logger", "logfmt_value"]

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


class _Values(logging.Filter):
    """Makes every argument of a record that is not a number a logfmt value."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and args:
            record.args = tuple(
                # Numbers of any kind (numpy's too) stay numbers for %d and %.1f.
                a if a is None or isinstance(a, numbers.Number) else logfmt_value(str(a))
                for a in args
            )
        return True


_FILTER = _Values()


def get_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` with the values of its records made logfmt
    values (once per logger, however often it is asked for)."""
    log = logging.getLogger(name)
    if _FILTER not in log.filters:
        log.addFilter(_FILTER)
    return log
