"""Listings (`ls`, `gc`) of any length: drawn as rich draws them, in a
fraction of its time.

rich took 14 s to print `ls` of a 20,000-entry store; kvkeeper draws long
and piped listings itself. These tests hold that drawing to rich's own, which
is the independent reader here: the same characters for any cell text.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from rich.cells import cell_len
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from kvkeeper.client.client import Client
from kvkeeper.plaintable import render

from .conftest import WAIT, RunningDaemon, start_daemon
from .test_cli_checks import cli, small_cache

PIPED = {"FORCE_COLOR": "", "TTY_COMPATIBLE": ""}  # whatever the CI's own setting
TERMINAL = {"FORCE_COLOR": "1", "TTY_COMPATIBLE": "", "COLUMNS": "100"}

# Printable text as the CLI hands it over (control characters arrive escaped):
# wide and combining characters, emoji, spaces at either end.
cell_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cc", "Cf", "Cs", "Co",
                                                                       "Cn", "Zl", "Zp")),
                    max_size=25).filter(str.isprintable)


def _rich_piped(title: str, columns: list[tuple[str, str]], rows: list[list[str]]) -> str:
    """What rich prints for the table into a pipe as wide as the rows need."""
    table = Table(title=title)
    for header, justify in columns:
        # As Text: a str header is rich markup ("\\[" drawn as "["), and the
        # CLI's headers are plain words.
        table.add_column(Text(header), justify=justify,  # type: ignore[arg-type]
                         overflow="fold" if justify == "left" else "ellipsis")
    for row in rows:
        table.add_row(*[Text(c) for c in row])
    probe = Console(file=io.StringIO(), highlight=False, soft_wrap=True, width=80)
    need = Measurement.get(probe, probe.options.update_width(1 << 20), table).maximum
    console = Console(file=io.StringIO(), highlight=False, soft_wrap=True,
                      width=max(80, need), force_terminal=False)
    console.print(table)
    return console.file.getvalue()  # type: ignore[attr-defined]


@settings(max_examples=300, deadline=None)
@given(data=st.data(), title=st.sampled_from(["", "3 entries, 1.0 KiB", "evicted 0"]))
def test_drawn_as_rich_draws_it(data: st.DataObject, title: str) -> None:
    # Headers at least one cell wide, as the CLI's are: rich leaves out what
    # a column 0 wide holds (a lone skin-tone modifier), plaintable does not.
    columns = data.draw(st.lists(st.tuples(cell_text.filter(lambda h: cell_len(h) > 0),
                                           st.sampled_from(["left", "right"])),
                                 min_size=1, max_size=6))
    rows = data.draw(st.lists(st.lists(cell_text, min_size=len(columns),
                                       max_size=len(columns)), max_size=6))
    assert render(title, columns, rows) == _rich_piped(title, columns, rows)  # type: ignore[arg-type]


def test_markup_characters_are_drawn_as_they_are() -> None:
    """Found by the test above once (a header "\\["), when it handed rich its
    headers as markup."""
    columns = [("\\[", "left"), ("[b]x[/b]", "right")]
    rows = [["[i]y[/i]", "\\[z]"]]
    drawn = render("", columns, rows)  # type: ignore[arg-type]
    assert drawn == _rich_piped("", columns, rows)  # type: ignore[arg-type]
    assert "\\[" in drawn and "[b]x[/b]" in drawn and "[i]y[/i]" in drawn


def test_piped_ls_and_gc_list_long_odd_names_whole(client: Client, daemon: RunningDaemon) -> None:
    sock = str(daemon.socket)
    long_id = "conversation-" + "x" * 140
    names = [("model-a", long_id), ("日本語モデル", "e\u0301 wide 日本 ids "), ("model-a", "tab\there")]
    for model, cache_id in names:
        assert client.save(model, cache_id, small_cache(), [1])
    assert client.flush(timeout=WAIT)
    r = cli("ls", "--socket", sock, env=PIPED)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("3 entries, ")
    table = lines[1:]
    assert len(table) == 3 + 4, r.stdout  # one line each: nothing folded at 80 columns
    assert len({cell_len(line) for line in table}) == 1, r.stdout  # every line as wide
    assert cell_len(table[0]) > len(long_id)
    rows = "\n".join(table[3:-1])
    assert long_id in rows and "日本語モデル" in rows and "tab\\there" in rows
    assert "e\u0301 wide 日本 ids " in rows
    listed = {e["cache_id"] for e in json.loads(cli("ls", "--socket", sock, "--json").stdout)}
    assert listed == {cache_id for _, cache_id in names}

    r = cli("gc", "--socket", sock, env=PIPED)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "evicted nothing", r.stdout  # not an empty table


def test_gc_lists_what_it_evicted_unfolded(short_dir: Path) -> None:
    long_id = "evicted-" + "y" * 120
    root = short_dir / "root"
    (root / "sessions").mkdir(parents=True)
    os.chmod(root, 0o700)
    # Another program's file fills the budget: a save keeps the entry it
    # wrote, and gc then evicts it.
    (root / "sessions" / "notes.txt").write_bytes(b"n" * 300_000)
    rd = start_daemon(root, short_dir / "kv.sock", max_disk_bytes=200_000)
    try:
        with Client(rd.socket, timeout=WAIT) as kv:
            assert kv.save("m", long_id, small_cache(), [1]) and kv.flush(timeout=WAIT)
        r = cli("gc", "--socket", str(rd.socket), env=PIPED)
    finally:
        assert rd.stop() == 0
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "evicted 1", r.stdout
    assert any(line.startswith("│ m ") and long_id in line for line in lines), r.stdout


def test_a_terminal_gets_rich_until_the_listing_is_long(
    client: Client, daemon: RunningDaemon
) -> None:
    sock = str(daemon.socket)
    for i in range(3):
        assert client.save("m", f"few-{i}", small_cache(), [1])
    assert client.flush(timeout=WAIT)
    few = cli("ls", "--socket", sock, env=TERMINAL)
    assert few.returncode == 0, few.stderr
    assert "\x1b[" in few.stdout  # rich's styles: a terminal's table
    for i in range(1001):
        assert client.save("m", f"many-{i:04d}", small_cache(), [1])
    assert client.flush(timeout=WAIT)
    many = cli("ls", "--socket", sock, env=TERMINAL)
    assert many.returncode == 0, many.stderr
    assert "\x1b[" not in many.stdout
    lines = many.stdout.splitlines()
    assert lines[0].startswith("1004 entries, ") and len(lines) == 1004 + 4 + 1
    assert all("many-" in line or "few-" in line for line in lines[4:-1])


def test_an_output_that_cannot_show_a_name_gets_it_escaped(
    client: Client, daemon: RunningDaemon
) -> None:
    """PYTHONIOENCODING=ascii (or a C locale without UTF-8): names it cannot
    show are written as escapes, in a table still aligned, where the command
    ended in a UnicodeEncodeError traceback."""
    assert client.save("日本", "é id", small_cache(), [1]) and client.flush(timeout=WAIT)
    for args in (("ls",), ("ls", "--all")):
        r = cli(*args, "--socket", str(daemon.socket), env={**PIPED, "PYTHONIOENCODING": "ascii"})
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        assert r.stdout.isascii() and "\\u65e5\\u672c" in r.stdout and "\\xe9 id" in r.stdout
        table = r.stdout.splitlines()[1:]
        assert len({len(line) for line in table}) == 1, r.stdout
