"""``kvkeeper demo``: what the daemon buys a generation loop, measured here.

Builds a tiny llama with random weights (no download), streams a few hundred
tokens after a long prompt while saving behind the loop, drops the in-memory
cache as a crash would, restores it from kvkeeper and continues the
conversation; then does the same request again without kvkeeper (a cold
re-prefill, with no saves) and prints both side by side.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "main", "tiny_llama", "word_tokenizer"]

MODEL_ID = "kvkeeper-demo-tiny-llama"
ROUNDS = 3  # decode rounds per mode, alternating; the best counts


# --------------------------------------------------------------------------- building blocks


def word_tokenizer(vocab_size: int = 1000) -> Any:
    """A real Hugging Face fast tokenizer (word level, no download): token 0 is
    ``<pad>`` (also the unknown token), every other id a made-up word, so that
    streamed text looks like text. Works with mlx-lm's ``TokenizerWrapper`` and
    as an mlx-vlm processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    consonants, vowels = "bdfgklmnprstvz", "aeiou"
    syllables = [c + v for c in consonants for v in vowels]
    if not 2 <= vocab_size <= 1 + len(syllables) * (len(syllables) + 1):
        raise ValueError(f"vocab_size must be 2..{1 + len(syllables) * (len(syllables) + 1)}")
    words = ["<pad>"]
    i = 0
    while len(words) < vocab_size:
        a, b = divmod(i, len(syllables))
        words.append(syllables[b] if a == 0 else syllables[a - 1] + syllables[b])
        i += 1
    tok = Tokenizer(models.WordLevel({w: k for k, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<pad>", pad_token="<pad>")


def tiny_llama(
    *,
    layers: int = 4,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 4,
    vocab_size: int = 1000,
    seed: int = 0,
) -> Any:
    """An mlx-lm llama with random weights, small enough for a CPU."""
    import mlx.core as mx
    from mlx.utils import tree_map_with_path
    from mlx_lm.models import llama

    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=2 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rms_norm_eps=1e-5,
        vocab_size=vocab_size,
        max_position_embeddings=8192,
    )
    model = llama.Model(args)
    # Louder projections than the default init, so that the output depends on
    # the attention over the cache instead of echoing the input token.
    model.update(tree_map_with_path(
        lambda path, p: p * 4 if p.ndim == 2 and "embed" not in path else p,
        model.parameters(),
    ))
    model.set_dtype(mx.bfloat16)
    model.eval()
    mx.eval(model.parameters())
    return model


# --------------------------------------------------------------------------- the daemon


def _ping(socket: Path | None, timeout: float = 1.0) -> bool:
    from kvkeeper.client.client import Client

    kv = Client(socket, connect_timeout=timeout)
    try:
        return kv.connected
    finally:
        kv.close(0)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM back until the clean-up inside is done, then
    raise the first one that came again, for the handlers put back. A
    second signal cut the clean-up short: two Ctrl-C 10-20 ms apart left
    the demo's entry in the user's store in 4 of 4 runs, a double Ctrl-C
    left a private daemon's directory. (Its waits are bounded: closes, a
    delete, the daemon's stop.)"""
    came: list[int] = []
    before: dict[signal.Signals, Any] = {}
    try:
        try:
            for signum in (signal.SIGINT, signal.SIGTERM):
                before[signum] = signal.signal(signum, lambda s, _frame: came.append(s))
        except ValueError:  # not the main thread: signals are not ours to hold
            pass
        yield
    finally:  # (also what was taken when a signal came between the two)
        for signum, handler in before.items():
            signal.signal(signum, handler)
        if came:
            signal.raise_signal(came[0])


class NoDaemon(Exception):
    """No daemon answers at the socket the user named."""


class NoRoom(Exception):
    """The daemon the user named has no room for the demo without evicting."""


def entry_bytes(args: argparse.Namespace) -> int:
    """At least the largest the demo's entry grows: its longest conversation
    (prompt, stream, new message, continuation, then a decode round's as
    many again) at the tiny llama's 4 KV heads of hidden/4 in bf16, keys
    and values, over every layer; its token ids and header besides."""
    tokens = args.prompt_tokens + args.tokens + 32 + 2 * max(16, args.tokens // 2) + 2
    return tokens * (args.layers * 4 * args.hidden + 8) + 64 * 1024


def _no_room(socket: Path, need: int) -> str | None:
    """Why the daemon at ``socket`` has no room for ``need`` more bytes
    without evicting entries (its disk budget, the free space it keeps; or
    it cannot be told yet), said after "no room for the demo's files";
    None if it has."""
    from kvkeeper.client.client import Client

    with Client(socket, connect_timeout=1.0) as kv:
        stats = kv.stats()
    beside = " without evicting entries: "
    used, limit = int(stats.get("disk_used_bytes", 0)), int(stats.get("max_disk_bytes", 0))
    if limit and need > limit:
        # Nothing to evict would make room: an empty store was said to hold
        # "0 KiB of its 1.0 MiB disk budget", as if entries were in the way.
        return f": its whole disk budget is {_mib(limit)} (--max-disk-bytes)"
    if limit and stats.get("store_indexing"):
        return (f"{beside}it is still indexing its store, so how much of its disk budget "
                "is used cannot be told yet (try again in a moment)")
    if limit and used + need > limit:
        return f"{beside}its store holds {_mib(used)} of its {_mib(limit)} disk budget"
    # Its store's disk as the daemon sees it (-1: no size, as ramfs, where it
    # keeps nothing free; an older daemon does not say).
    free, keep = int(stats.get("free_bytes", -1)), int(stats.get("min_free_bytes", 0))
    if free >= 0 and free - need < keep:
        return f"{beside}its disk has {_mib(free)} free, of which it keeps {_mib(keep)}"
    return None


@contextlib.contextmanager
def _daemon(socket: Path | None, private: bool, need: int) -> Iterator[tuple[Path, str, bool]]:
    """With ``private`` off, the daemon at ``socket`` if one answers (none is
    NoDaemon: the user asked for that one); with no ``socket``, the user's if
    one answers, else (and with ``private``) a private one in a temp dir,
    stopped at the end. A running daemon must have room for ``need`` bytes
    without evicting the user's entries: the one named is refused (NoRoom),
    the user's is passed over for a private one. Yields the socket, what to
    say of the daemon, and whether it is the demo's own."""
    from kvkeeper import settings
    from kvkeeper.ops.common import no_daemon, shell_word

    if socket is not None and not private:
        if not _ping(socket, 2.0):
            raise NoDaemon(no_daemon(socket, f" (start it: kvkeeper serve --socket="
                                             f"{shell_word(socket)}; or leave out "
                                             f"--socket and the demo starts a private one)"))
        if (why := _no_room(socket, need)) is not None:
            raise NoRoom(f"the daemon at {socket} has no room for the demo's files (up to "
                         f"{_mib(need)}){why}; give --private to run the demo on a daemon "
                         f"of its own")
        yield socket, f"running daemon at {socket}", False
        return
    note = ""
    if not private:
        path = settings.client_path("socket")
        if _ping(path):
            why = _no_room(path, need)
            if why is None:
                yield path, f"running daemon at {path}", False
                return
            note = (f" (the running daemon at {path} has no room for the demo's files, up to "
                    f"{_mib(need)}{why})")
    tmp = Path(tempfile.mkdtemp(prefix="kvk-demo-", dir="/tmp"))
    os.chmod(tmp, 0o700)
    path = tmp / "kv.sock"
    log_path = tmp / "daemon.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            # A throwaway store: no free space to keep on /tmp (a small tmpfs
            # there would be refused, or would evict the demo's own entries).
            [sys.executable, "-m", "kvkeeper.cli", "serve", "--root", str(tmp / "root"),
             "--socket", str(path), "--log-level", "warning", "--min-free-bytes", "0"],
            stdout=subprocess.DEVNULL, stderr=log_file,
        )
    try:
        deadline = time.monotonic() + 20
        while not (path.exists() and _ping(path, 0.5)):
            if proc.poll() is not None:
                err = log_path.read_text(errors="replace").strip()
                raise RuntimeError(f"the private daemon exited with {proc.returncode}: {err}")
            if time.monotonic() > deadline:
                raise RuntimeError("the private daemon did not start within 20 s")
            time.sleep(0.05)
        yield path, f"private daemon in {tmp} (stopped at the end){note}", True
    finally:
        with _signals_held():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
            shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- the run


@dataclass
class Phase:
    """One measured generation."""

    prompt_tokens: int = 0  # fed to the model
    generated: int = 0
    ttft_s: float = 0.0  # from the request to the first token (restore included)
    decode_tps: float = 0.0  # mlx-lm's own generation_tps
    tokens: list[int] = field(default_factory=list, repr=False)


@dataclass
class Decode:
    """Decode throughput from one context, best of a few alternating rounds."""

    label: str
    every_tokens: int | None
    tokens: int
    tps: list[float] = field(default_factory=list)
    saves_sent: int = 0

    @property
    def best(self) -> float:
        return max(self.tps)

    @property
    def spread(self) -> float:
        """How much the rounds differed, relative to the best."""
        return (max(self.tps) - min(self.tps)) / max(self.tps)


@dataclass
class Report:
    model: str
    daemon: str
    prompt_tokens: int
    stream_tokens: int
    continue_tokens: int
    every_tokens: int
    stream: Phase
    lost_tokens: int  # of the crashed stream, those the restore did not find
    restored_tokens: int
    load_s: float
    restored: Phase
    cold: Phase
    decode: list[Decode]
    decode_context: int
    decode_same_tokens: bool  # every decode run produced the same tokens
    saves_sent: int
    saves_dropped: int
    saves_coalesced: int  # replaced in the client while waiting out its send interval
    saves_written: int
    saves_superseded: int
    saves_failed: int
    stream_saves_dropped: int  # of saves_dropped, those of the stream before the crash
    # Entries the daemon evicted meanwhile (its disk budget): on a running
    # daemon, maybe the user's, though the demo checked for room first.
    evictions: int
    bytes_written: int
    cache_bytes: int
    same_tokens: int  # leading tokens where restored and cold continuations agree
    wall_s: float


def _stream(gen: Iterator[Any], on_token: Any = None) -> Phase:
    """Drain an mlx-lm response stream, timing the first token."""
    t0 = time.perf_counter()
    phase = Phase()
    last = None
    for r in gen:
        if last is None:
            phase.ttft_s = time.perf_counter() - t0
        last = r
        phase.tokens.append(int(r.token))
        if on_token is not None:
            on_token(r)
    assert last is not None
    phase.prompt_tokens = last.prompt_tokens
    phase.generated = last.generation_tokens
    phase.decode_tps = last.generation_tps
    return phase


def run(args: argparse.Namespace, socket: Path, daemon_note: str, private: bool) -> Report:
    """The demo's run against the daemon at ``socket`` (``private``: its own).
    Its entry is deleted however the run ends (Ctrl-C and SIGTERM too): a
    store that is the user's must not keep it, and if it cannot be, the
    user is told how."""
    from kvkeeper.client.client import Client, DaemonUnavailable
    from kvkeeper.ops.common import one_line, shell_word

    sid = f"demo-{os.getpid()}-{int(time.time())}"
    opened: list[Client] = []

    def client() -> Client:
        opened.append(Client(socket))
        return opened[-1]

    try:
        return _run(args, daemon_note, sid, client)
    finally:
        with _signals_held():
            # Each client's saves first: closed, every one was read by the
            # daemon, and the delete comes after them.
            for kv in opened:
                kv.close()
            try:
                with Client(socket) as kv:
                    kv.delete(MODEL_ID, sid)
            except DaemonUnavailable as exc:
                if not private:  # (a private store goes with its directory)
                    print(f"kvkeeper demo: its entry could not be deleted ({one_line(exc)}); "
                          f"delete it with: kvkeeper rm --socket={shell_word(socket)} "
                          f"{MODEL_ID} {sid}", file=sys.stderr)


def _progress(text: str) -> None:
    """Say on a terminal what the run does now: the report comes at the end,
    and before it the terminal stayed silent for the whole run (20-60 s)."""
    if sys.stderr.isatty():
        print(f"kvkeeper demo: {text}", file=sys.stderr, flush=True)


def _run(args: argparse.Namespace, daemon_note: str, sid: str,
         client: Callable[[], Any]) -> Report:
    import mlx.core as mx
    import numpy as np
    from mlx_lm.generate import stream_generate
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from kvkeeper.integrations.mlx_lm import Session
    from kvkeeper.writebehind import cache_length

    t_start = time.perf_counter()
    _progress("building a tiny model with random weights, warming MLX up")
    vocab = 2000
    model = tiny_llama(layers=args.layers, hidden=args.hidden, vocab_size=vocab)
    tok = TokenizerWrapper(word_tokenizer(vocab))
    rng = np.random.default_rng(args.seed)
    prompt = [int(t) for t in rng.integers(1, vocab, args.prompt_tokens)]
    user = [int(t) for t in rng.integers(1, vocab, 32)]
    n_stream, n_cont, every = args.tokens, max(16, args.tokens // 2), args.every_tokens
    # Warm MLX up (first calls compile and allocate), outside every measurement.
    for _ in stream_generate(model, tok, mx.array(prompt[:64]), max_tokens=8,
                             prompt_cache=make_prompt_cache(model)):
        pass

    # 1. Stream with write-behind: the plain helper inside mlx-lm's own loop.
    _progress(f"1/5 streaming {n_stream} tokens, saved behind every {every}")
    kv = client()
    before = kv.stats()
    cache: Any = make_prompt_cache(model)  # (Any: dropped below, at the crash)
    ids = list(prompt)
    wb: Any = kv.write_behind(MODEL_ID, sid, every_tokens=every, every_seconds=2.0)

    def step(r: Any) -> None:
        ids.append(int(r.token))
        wb.step(cache, ids)

    stream = _stream(stream_generate(model, tok, mx.array(prompt), max_tokens=n_stream,
                                     prompt_cache=cache), step)
    sent, dropped = wb.counters.sent, wb.counters.dropped
    stream_dropped = dropped
    # 2. Crash: the cache is gone and there is no final save. (Closing the
    # client lets what it already handed off reach the daemon.)
    _progress("2/5 dropping the cache, as a crash would")
    cache = wb = None  # nothing of the live cache survives
    kv.close()
    coalesced = kv.client_stats()["client_saves_coalesced"]

    # 3. Restart: a new client and session restore the newest snapshot and
    # go on with the conversation: the whole of it, plus a new message.
    full = ids + user
    _progress(f"3/5 restoring it and continuing with {n_cont} tokens")
    kv = client()
    session = Session(kv, MODEL_ID, sid, model, tok, every_tokens=every, every_seconds=2.0)
    t0 = time.perf_counter()
    session.restore()
    load_s = time.perf_counter() - t0
    restored_tokens = len(session.token_ids or [])
    restored = _stream(session.stream_generate(full, max_tokens=n_cont))
    restored.ttft_s += load_s
    if session.last_write_behind is not None:
        sent += session.last_write_behind.counters.sent
        dropped += session.last_write_behind.counters.dropped
    base_cache, base_ids = session.cache, list(session.token_ids or [])
    assert base_cache is not None
    cache_bytes = sum(int(c.nbytes) for c in base_cache)

    # 4. The same request without kvkeeper: re-prefill everything, no saves.
    _progress("4/5 the same request re-prefilled, without kvkeeper")
    cold = _stream(stream_generate(model, tok, mx.array(full), max_tokens=n_cont,
                                   prompt_cache=make_prompt_cache(model)))
    same = 0
    for a, b in zip(restored.tokens, cold.tokens, strict=False):
        if a != b:
            break
        same += 1

    # 5. Decode throughput from one context, without and with write-behind,
    # alternating rounds (the machine may be shared: the best round counts).
    # The every-token stress rounds are a quarter as long: each save writes
    # the whole cache, and they are there to show the daemon coalescing.
    modes = [Decode("no write-behind", None, n_cont),
             # (At most 29 columns: the table's first; "1 tokens" read badly.)
             Decode("write-behind every token" if every == 1 else
                    f"write-behind every {every} tok" if every >= 1000 else
                    f"write-behind every {every} tokens", every, n_cont),
             Decode("stress: saving every token", 1, max(8, n_cont // 4))]
    outputs: dict[int, set[tuple[int, ...]]] = {}
    _progress(f"5/5 decoding with and without write-behind, {ROUNDS} rounds")
    for _round in range(ROUNDS):
        for mode in modes:
            trim_prompt_cache(base_cache, (cache_length(base_cache) or 0) - (len(base_ids) - 1))
            ids = base_ids[:-1]
            mode_wb = (kv.write_behind(MODEL_ID, sid, every_tokens=mode.every_tokens,
                                  every_seconds=None) if mode.every_tokens else None)

            def mode_step(r: Any, wb: Any = mode_wb, ids: list[int] = ids) -> None:
                ids.append(int(r.token))
                if wb is not None:
                    wb.step(base_cache, ids)

            ids.append(base_ids[-1])
            phase = _stream(stream_generate(model, tok, mx.array(base_ids[-1:]),
                                            max_tokens=mode.tokens, prompt_cache=base_cache),
                            mode_step)
            mode.tps.append(phase.decode_tps)
            outputs.setdefault(mode.tokens, set()).add(tuple(phase.tokens))
            if mode_wb is not None:
                mode.saves_sent += mode_wb.counters.sent
                sent += mode_wb.counters.sent
                dropped += mode_wb.counters.dropped

    kv.flush(timeout=60)
    after = kv.stats()
    coalesced += int(after["client_saves_coalesced"])

    def delta(name: str) -> int:
        return int(after.get(name, 0) - before.get(name, 0))

    return Report(
        model=f"tiny llama, {args.layers} layers, hidden {args.hidden}, random weights",
        daemon=daemon_note,
        prompt_tokens=len(prompt),
        stream_tokens=n_stream,
        continue_tokens=n_cont,
        every_tokens=every,
        stream=stream,
        # Not from the saves handed off: the newest one may still be held
        # (the client's min_send_interval, the daemon's --min-write-interval)
        # when the new client reads the file, as with short settings.
        lost_tokens=len(prompt) + n_stream - restored_tokens,
        restored_tokens=restored_tokens,
        load_s=load_s,
        restored=restored,
        cold=cold,
        decode=modes,
        decode_context=len(base_ids),
        decode_same_tokens=all(len(v) == 1 for v in outputs.values()),
        saves_sent=sent,
        saves_dropped=dropped,
        stream_saves_dropped=stream_dropped,
        saves_coalesced=coalesced,
        saves_written=delta("saves_written"),
        saves_superseded=delta("saves_superseded"),
        saves_failed=delta("saves_failed"),
        evictions=delta("evictions"),
        bytes_written=delta("bytes_written"),
        cache_bytes=cache_bytes,
        same_tokens=same,
        wall_s=time.perf_counter() - t_start,
    )


# --------------------------------------------------------------------------- the report


def than_reprefill(cold_s: float, restored_s: float) -> str:
    """How the restored request's first token compared with the re-prefill's:
    "21x sooner", or "2.5x later" (a short conversation on a small model can
    take longer to load than to prefill again)."""
    if restored_s <= cold_s:
        ratio, word = cold_s / max(restored_s, 1e-9), "sooner"
    else:
        ratio, word = restored_s / max(cold_s, 1e-9), "later"
    return f"{ratio:.{0 if ratio >= 10 else 1}f}x {word}"


def _mib(n: float) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"  # ("0.0 MiB")


def print_report(rep: Report) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    con = Console(soft_wrap=True)
    con.print(f"[bold]kvkeeper demo[/]: {rep.model}")
    con.print(f"daemon: {rep.daemon}\n")
    con.print(f" 1. streamed {rep.stream_tokens} tokens after a {rep.prompt_tokens}-token "
              f"prompt, saving behind every "
              f"{'token' if rep.every_tokens == 1 else f'{rep.every_tokens} tokens'}")
    # (Dropped saves, not time, when the client dropped them: too large for
    # the daemon, or its in-flight budget full; the log says which.)
    why = (f"the client dropped {rep.stream_saves_dropped} of its saves"
           if rep.stream_saves_dropped else "not saved in time")
    con.print(f" 2. crash: the in-memory cache is gone (the last {rep.lost_tokens} tokens "
              f"were lost: {why})" if rep.lost_tokens else
              " 2. crash: the in-memory cache is gone (every token was saved)")
    con.print(f" 3. restart: restored {rep.restored_tokens} tokens from kvkeeper, read "
              f"{rep.restored.prompt_tokens} new ones, continued {rep.restored.generated}"
              if rep.restored_tokens else
              f" 3. restart: no save to restore; read all {rep.restored.prompt_tokens} tokens "
              f"again, continued {rep.restored.generated}")
    con.print(f" 4. the same request without kvkeeper: re-prefilled {rep.cold.prompt_tokens} "
              f"tokens, continued {rep.cold.generated}")
    con.print(f" 5. decoded from a {rep.decode_context}-token context without and with "
              f"write-behind, in alternating rounds\n")

    def table(title: str) -> Table:
        t = Table(title=title, title_justify="left", title_style="bold", box=box.SIMPLE,
                  show_header=False, pad_edge=False)
        t.add_column(width=29, no_wrap=True)
        t.add_column(justify="right", width=12, no_wrap=True)
        t.add_column(style="dim", width=35)
        return t

    ttft = table("Time to first token")
    ttft.add_row(f"re-prefill ({rep.cold.prompt_tokens} tokens)", f"{rep.cold.ttft_s:.2f} s", "")
    ttft.add_row("restored from kvkeeper", f"{rep.restored.ttft_s:.2f} s",
                 f"{than_reprefill(rep.cold.ttft_s, rep.restored.ttft_s)} (load "
                 f"{rep.load_s * 1000:.0f} ms + {rep.restored.prompt_tokens} tokens)")
    con.print(ttft)

    dec = table(f"Decode throughput (best of {ROUNDS} rounds)")
    plain = rep.decode[0]
    for mode in rep.decode:
        note = (f"noise: its rounds differed {plain.spread:.0%}" if mode.every_tokens is None else
                f"{mode.best / plain.best - 1:+.0%}, {mode.saves_sent} saves"
                + (f" of {_mib(rep.cache_bytes)}" if mode.every_tokens == 1 else ""))
        dec.add_row(mode.label, f"{mode.best:.0f} tok/s", note)
    con.print(dec)

    wbt = table("Write-behind: what the daemon did")
    wbt.add_row("saves the loops handed off", f"{rep.saves_sent}",
                f"{rep.saves_dropped} dropped by the client")
    wbt.add_row("written to disk", f"{rep.saves_written}", f"{rep.saves_failed} failed")
    wbt.add_row("coalesced in the client", f"{rep.saves_coalesced}",
                "a newer save came within the send interval")
    wbt.add_row("coalesced in the daemon", f"{rep.saves_superseded}",
                "superseded: a newer save came while pending")
    wbt.add_row("bytes written", _mib(rep.bytes_written),
                f"cache: {_mib(rep.cache_bytes)}")
    con.print(wbt)

    n = min(len(rep.restored.tokens), len(rep.cold.tokens))
    agree = ("identical" if rep.same_tokens == n else
             f"identical for {rep.same_tokens} of {n} tokens (a cold prefill may round "
             f"differently)")
    con.print(f"Restored vs re-prefilled continuation: {agree}.")
    con.print("Tokens decoded with and without write-behind: "
              + ("identical." if rep.decode_same_tokens else "DIFFERENT."))
    if rep.evictions:
        con.print(f"[yellow]The daemon evicted {rep.evictions} "
                  f"{'entry' if rep.evictions == 1 else 'entries'} meanwhile, to keep within "
                  f"its disk budget or the free space it keeps (see its log).[/]")
    con.print(f"[dim]Measured just now, in {rep.wall_s:.1f} s; nothing here is canned.[/]")


# --------------------------------------------------------------------------- entry point


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvkeeper.cli import _socket  # the same --socket as every other command

    p.add_argument("--tokens", type=int, default=300, metavar="N",
                   help="tokens to stream before the crash (default 300, at least 2)")
    p.add_argument("--prompt-tokens", type=int, default=1500, metavar="N",
                   help="length of the first prompt (default 1500, at least 64)")
    p.add_argument("--every-tokens", type=int, default=64, metavar="N",
                   help="save behind every N tokens (default 64, 1 to 99999)")
    p.add_argument("--layers", type=int, default=4, metavar="N",
                   help="model layers (default 4, at least 1)")
    p.add_argument("--hidden", type=int, default=256, metavar="N",
                   help="model width, a multiple of 8 (default 256, at least 8)")
    p.add_argument("--seed", type=int, default=0, metavar="N",
                   help="prompt seed (default 0, at least 0)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--socket", type=_socket, default=None, metavar="PATH",
                       help="use the daemon at this socket; if none answers there, exit 3 "
                            "(default: the user's daemon if it is running, else a private one)")
    where.add_argument("--private", action="store_true",
                       help="always start a private daemon in a temp dir")
    p.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help="also write the measurements to PATH as JSON")


def _cannot_write(path: Path) -> str | None:
    """Why a file cannot be written at ``path`` (None: it can), tried by
    opening it for appending; a file made for the try is removed (through
    a symlink to nothing, the file made, not the link). (Asking access() is
    not enough: it answers yes to root for /proc.)"""
    try:
        if path.is_dir() or not path.parent.is_dir():
            return "not a file in an existing directory"
        existed = path.exists()  # through a symlink
        with open(path, "a"):
            pass
    except OSError as exc:  # (pathlib lets EACCES through: a directory not searchable)
        return f"cannot be written: {exc.strerror or exc}"
    if not existed:
        Path(os.path.realpath(path)).unlink(missing_ok=True)
    return None


def main(args: argparse.Namespace) -> int:
    from kvkeeper import config
    from kvkeeper.client.client import DaemonUnavailable
    from kvkeeper.ops.common import one_line

    # hidden: 4 attention heads, each of an even width for RoPE.
    wrong = [f"{flag} {need} (got {value})" for flag, value, ok, need in (
        ("--tokens", args.tokens, args.tokens >= 2, "at least 2"),
        ("--prompt-tokens", args.prompt_tokens, args.prompt_tokens >= 64, "at least 64"),
        # (Past 99,999 its row's label no longer fits the table.)
        ("--every-tokens", args.every_tokens, 1 <= args.every_tokens <= 99_999,
         "from 1 to 99999"),
        ("--layers", args.layers, args.layers >= 1, "at least 1"),
        ("--seed", args.seed, args.seed >= 0, "at least 0"),
        ("--hidden", args.hidden, args.hidden >= 8 and args.hidden % 8 == 0,
         "a multiple of 8, at least 8"),
    ) if not ok]
    if wrong:  # only the flags that are wrong (all were listed, so which was not said)
        print(f"kvkeeper demo: need {', '.join(wrong)}", file=sys.stderr)
        return 2
    # Found out after the run, it would cost the measurements.
    if args.json is not None and (why := _cannot_write(args.json)) is not None:
        print(f"kvkeeper demo: --json {args.json}: {why}", file=sys.stderr)
        return 2
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        import mlx_lm  # noqa: F401
        import rich  # noqa: F401
    except ImportError as exc:
        from kvkeeper.client import MLX_EXTRA

        print(f"kvkeeper demo needs the mlx extra ({MLX_EXTRA}): {exc}", file=sys.stderr)
        return 2
    try:
        if not args.private:  # a private daemon's socket is the demo's own choice
            from kvkeeper import settings

            config.check_socket_path(args.socket if args.socket is not None
                                     else settings.client_path("socket"))
        with _daemon(args.socket, args.private, 2 * entry_bytes(args)) as (socket, note, own):
            rep = run(args, socket, note, own)
    except Exception as exc:
        status = {NoDaemon: 3, DaemonUnavailable: 3, NoRoom: 1,
                  config.ConfigError: 2,  # $KVKEEPER_SOCKET names no local socket
                  RuntimeError: 1}
        for kind, code in status.items():
            if isinstance(exc, kind):
                print(f"kvkeeper demo: {one_line(exc)}", file=sys.stderr)
                return code
        raise
    print_report(rep)
    if args.json is not None:
        data = asdict(rep)
        for phase in ("stream", "restored", "cold"):
            data[phase].pop("tokens", None)
        try:
            args.json.write_text(json.dumps(data, indent=1))
        except OSError as exc:  # checked above, but a file system may still refuse
            print(f"kvkeeper demo: cannot write --json {args.json}: {exc.strerror or exc} "
                  f"(the report above has the measurements)", file=sys.stderr)
            return 1
    return 0
