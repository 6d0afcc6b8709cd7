"""Hostile input and local security: fuzzed messages, hostile ids and class
names, other users, planted symlinks, a second daemon."""

from __future__ import annotations

import math
import os
import pwd
import re
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import get_args

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

import kvkeeper
from kvkeeper.client.client import Client
from kvkeeper.client.reader import CacheFileError
from kvkeeper.protocol import messages as m
from kvkeeper.protocol.dtypes import DTYPE_SIZES

from .conftest import (
    WAIT,
    RunningDaemon,
    dealer,
    ping,
    serve_process,
    start_daemon,
    stop_process,
)
from .faultkit import FP, entry_path, filled, need_linux_root, resealed

V = m.PROTOCOL_VERSION
TAGS = ["ping", "save", "data", "load", "delete", "list", "stats", "flush", "quarantine", "pong"]

# ------------------------------------------------------------------ fuzzing

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(),
                    st.text(max_size=20), st.binary(max_size=20))
values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4)
                      | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=12)


def _packb(obj: object) -> bytes:
    try:
        return msgspec.msgpack.encode(obj)
    except (TypeError, OverflowError):
        return b"\xc1"


random_dicts = st.builds(
    lambda op, v, extra: _packb({"op": op, "v": v, **extra}),
    st.one_of(st.sampled_from(TAGS), st.text(max_size=10)),
    st.one_of(st.just(V), st.integers(-5, 5)),
    st.dictionaries(st.sampled_from(["req", "save", "model", "cache_id", "tensors", "frames",
                                     "metadata", "path", "junk"]), values, max_size=5),
)

bad_specs = st.lists(
    st.tuples(
        st.text(max_size=6),
        st.one_of(st.sampled_from(sorted(DTYPE_SIZES)), st.sampled_from(["Q4", "", "f32"])),
        st.lists(st.one_of(st.integers(0, 8), st.just(2**40)), max_size=4),
    ),
    max_size=4,
)


@st.composite
def broken_saves(draw: st.DrawFn) -> list[list[bytes]]:
    """A save that is wrong in at least one way, with whatever data follows."""
    save = draw(st.integers(0, 2**31))
    flaw = draw(st.sampled_from(["id", "dtype", "huge", "frames", "extra_bytes", "unknown"]))
    specs = [list(s) for s in draw(bad_specs)] or [["t", "F32", [4]]]
    model, cache_id = "fuzz", draw(st.text(min_size=1, max_size=10))
    if flaw == "id":
        cache_id = draw(st.sampled_from(["", "x" * 2000]))
    elif flaw == "dtype":
        specs[0][1] = "Q4"
    elif flaw == "huge":
        specs[0] = ["h", "BF16", [2**40]]
    body = {"op": "save", "v": V, "save": save, "model": model, "cache_id": cache_id,
            "tensors": specs}
    if flaw == "unknown":
        body["surprise"] = 1
    msgs = [[_packb(body)]]
    n = draw(st.integers(1, 3))
    data = [draw(st.binary(max_size=64)) for _ in range(n)]
    declared = n + 1 if flaw == "frames" else n
    if flaw == "extra_bytes":
        data.append(b"\0" * 10_000)
        declared = n + 1
    msgs.append([_packb({"op": "data", "v": V, "save": save, "frames": declared}), *data])
    return msgs


@st.composite
def well_formed(draw: st.DrawFn) -> list[list[bytes]]:
    """A valid request among the broken ones, sometimes with a stray data frame;
    reqs repeat, as a client's never do."""
    req = draw(st.integers(0, 3))
    key = {"model": "fuzz", "cache_id": draw(st.sampled_from(["a", "b", ""]))}
    msg = draw(st.sampled_from([
        m.Ping(v=V, req=req), m.GetStats(v=V, req=req), m.Load(v=V, req=req, **key),
        m.Used(v=V, ino=1, **key), m.Delete(v=V, req=req, **key), m.ListEntries(v=V, req=req),
        m.Flush(v=V, req=req), m.Gc(v=V, req=req),
        m.Quarantine(v=V, req=req, ino=1, mtime_ns=1, reason="fuzz", **key),
    ]))
    return [[m.encode(msg), *draw(st.lists(st.binary(max_size=8), max_size=1))]]


messages = st.one_of(
    well_formed(),
    st.binary(max_size=64).map(lambda b: [[b]]),
    random_dicts.map(lambda b: [[b]]),
    st.tuples(random_dicts, st.lists(st.binary(max_size=32), min_size=1, max_size=3))
    .map(lambda t: [[t[0], *t[1]]]),
    st.integers(1, 200_000).map(lambda d: [[b"\x91" * d + b"\xc0"]]),
    broken_saves(),
)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


#: Reply types of the requests the daemon may answer from a task of their own,
#: after it has read later messages: matched to their request by ``req``.
LATER = {m.Load: (m.Found,), m.Delete: (m.Deleted,), m.Quarantine: (m.Deleted,),
         m.ListEntries: (m.Entries,), m.Flush: (m.Flushed,), m.Gc: (m.Evicted,)}
CODES = set(get_args(m.ErrorCode))
PING_REQ = 2**61  # the test's own pings, far from the small ints the fuzz draws
# (and under DRAIN_ANSWER, which a daemon that told of no drain refuses)


class Ledger:
    """Each fuzzed message goes alone, followed by a ping: whatever its
    handler answers comes before that ping's pong, and is checked against what
    the protocol says the message must get. Answers given from a task (LATER)
    may come after, and are owed until one with their req arrives."""

    def __init__(self, s: zmq.Socket) -> None:
        self.s = s
        self.pings = 0
        self.owed: list[tuple[int, tuple[type, ...]]] = []
        self.sent = 0
        self.kinds: Counter[str] = Counter()  # how each message ended
        self.codes: Counter[str] = Counter()  # error codes of every refusal and error

    def replies(self) -> list[m.Reply]:
        """Ping, and return the replies that came before its pong."""
        self.pings += 1
        req = PING_REQ + self.pings
        self.s.send(m.encode(m.Ping(v=V, req=req)))
        got: list[m.Reply] = []
        deadline = time.monotonic() + WAIT
        while True:
            left = max(0.0, deadline - time.monotonic())
            assert self.s.poll(int(left * 1000)), "daemon stopped answering"
            reply = m.decode_reply(self.s.recv())  # typed, or DecodeFailure fails the test
            if isinstance(reply, m.Error | m.SaveRefused):
                assert reply.code in CODES, reply
                self.codes[reply.code] += 1
            if isinstance(reply, m.Pong) and reply.req == req:
                return got
            got.append(reply)

    def send(self, frames: list[bytes]) -> None:
        self.s.send_multipart(frames)
        self.sent += 1
        got = self.replies()
        kind = self._own(frames, got)
        self.kinds[kind] += 1
        self._settle(got)

    def _own(self, frames: list[bytes], got: list[m.Reply]) -> str:
        """Take the reply the message's own handler sent out of ``got``."""
        try:
            msg = m.decode_request(frames[0])
        except m.DecodeFailure as exc:
            code = exc.code  # the decoder's verdict is the error the daemon must give
            take(got, lambda r: isinstance(r, m.Error) and r.req is None and r.code == code)
            # A map whose op says save is a save refused: its sender's flush
            # must say so.
            return "SaveBegin undecodable" if _says_save(frames[0]) else "undecodable"
        name = type(msg).__name__
        if len(frames) > 1 and not isinstance(msg, m.SaveData):
            if isinstance(msg, m.SaveBegin):
                take(got, lambda r: isinstance(r, m.SaveRefused) and r.save == msg.save
                     and r.code == "frames")
            else:
                take(got, lambda r: isinstance(r, m.Error) and r.code == "frames"
                     and r.req == getattr(msg, "req", None))
            return f"{name} with data"
        if isinstance(msg, m.SaveBegin | m.SaveData):
            allowed = None if isinstance(msg, m.SaveBegin) else {"unknown_save", "frames"}
            refused = take(got, lambda r: isinstance(r, m.SaveRefused) and r.save == msg.save
                           and (allowed is None or r.code in allowed), optional=True)
            return f"{name} {'refused' if refused else 'taken'}"
        if isinstance(msg, m.Used):  # no reply, unless its ids are bad
            bad = take(got, lambda r: isinstance(r, m.Error) and r.req is None
                       and r.code == "bad_id", optional=True)
            return f"Used {'refused' if bad else 'taken'}"
        if isinstance(msg, m.Ping):
            take(got, lambda r: isinstance(r, m.Pong) and r.req == msg.req)
        elif isinstance(msg, m.GetStats):
            take(got, lambda r: isinstance(r, m.Stats) and r.req == msg.req)
        elif take(got, lambda r: isinstance(r, m.Error) and r.req == msg.req, optional=True):
            # Its own error (a bad id) comes at once; an answer may come later.
            # Reqs repeat, so an error taken later could be another's.
            return f"{name} refused"
        else:
            self.owed.append((msg.req, LATER[type(msg)]))
        return name

    def _settle(self, got: list[m.Reply]) -> None:
        """What is left must be owed answers, each owed once."""
        for reply in got:
            req = getattr(reply, "req", None)
            match = [i for i, (r, types) in enumerate(self.owed)
                     if r == req and isinstance(reply, (*types, m.Error))]
            assert match, f"a reply no message was owed: {reply}"
            del self.owed[match[0]]

    def settle_all(self) -> None:
        deadline = time.monotonic() + WAIT
        while self.owed:
            assert time.monotonic() < deadline, f"never answered: {self.owed}"
            self._settle(self.replies())
            time.sleep(0.05)


def _says_save(header: bytes) -> bool:
    try:
        doc = msgspec.msgpack.decode(header)
    except (msgspec.DecodeError, RecursionError, ValueError, TypeError):
        return False
    return isinstance(doc, dict) and doc.get("op") == "save"


def take(got: list[m.Reply], want: Callable[[m.Reply], bool], *, optional: bool = False) -> bool:
    """Remove from ``got`` the one reply ``want`` matches; fail on two, or on
    none unless ``optional``."""
    found = [r for r in got if want(r)]
    assert len(found) <= 1 and (optional or found), (found, got)
    if found:
        got.remove(found[0])
    return bool(found)


def test_fuzz_ten_thousand_malformed_messages(short_dir: Path) -> None:
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock, "--max-pending-bytes", "64M")
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"ipc://{sock}")
    ledger = Ledger(s)
    batches = [0]
    # Some fuzzed headers are valid saves that are complete without any data:
    # a broken_saves header (model "fuzz") whose tensors all have a zero in
    # their shape, whatever its data message does wrong afterwards, or a random
    # dict that happens to spell a save. The daemon rightly writes those; they
    # are the only saves allowed to reach the disk.
    valid = [0]

    def complete_without_data(req: m.Request) -> bool:
        return isinstance(req, m.SaveBegin) and (req.model != "fuzz" or all(
            0 in t.shape for t in req.tensors))
    try:
        rss0 = rss_kib(proc.pid)

        @settings(max_examples=300, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(st.lists(messages, min_size=30, max_size=50))
        def batch(msgs: list[list[list[bytes]]]) -> None:
            for group in msgs:
                for frames in group:
                    try:
                        valid[0] += complete_without_data(m.decode_request(frames[0]))
                    except m.DecodeFailure:
                        pass
                    ledger.send(frames)
            batches[0] += 1

        batch()
        # 400 frames of 1 MiB in one message: refused, and memory comes back.
        ledger.send([m.encode(m.SaveData(v=V, save=1, frames=255)), *[b"\0" * 2**20] * 400])
        ledger.settle_all()
        # A flush of this peer waits for every save it started: then each is done.
        s.send(m.encode(m.Flush(v=V, req=PING_REQ)))
        assert s.poll(int(WAIT * 1000)), "no answer to the flush"
        assert isinstance(m.decode_reply(s.recv()), m.Flushed)
        kinds, codes = ledger.kinds, ledger.codes
        print(f"fuzz: {ledger.sent} messages in {batches[0]} batches, {valid[0]} save headers "
              f"complete without data; {dict(kinds)}; error codes {dict(codes)}")
        clean = sum(kinds[k] for k in ("Ping", "GetStats", "Used taken",
                                        *(t.__name__ for t in LATER)))
        assert ledger.sent - clean >= 10_000, (ledger.sent, clean)  # malformed ones
        # Every message got exactly the answer the protocol gives it (checked
        # one by one above); those with none are a save or its data taken, or
        # a Used taken.
        silent = kinds["SaveBegin taken"] + kinds["SaveData taken"] + kinds["Used taken"]
        print(f"fuzz: {ledger.sent - silent} answered, {silent} taken without an answer")
        with Client(sock, timeout=WAIT) as kv:
            stats = kv.stats()
        # What the daemon counted is what it answered.
        begins = sum(n for k, n in kinds.items() if k.startswith("SaveBegin"))
        assert stats["saves_received"] == begins, (stats, kinds)
        assert stats["saves_refused"] == begins - kinds["SaveBegin taken"], (stats, kinds)
        assert stats["loads_direct"] == kinds["Used taken"], (stats, kinds)
        # Each protocol error counted had its typed answer.
        assert stats["protocol_errors"] == (kinds["undecodable"] + kinds["SaveBegin undecodable"]
                                            + codes["bad_id"]
                                            + kinds["SaveData refused"]), (stats, kinds, codes)
        assert stats["internal_errors"] == 0 and stats["forbidden_peers"] == 0, stats
        assert stats["saves_received"] == (stats["saves_written"] + stats["saves_superseded"]
                                           + stats["saves_refused"] + stats["saves_failed"]), stats
        assert stats["saves_written"] <= valid[0]
        files = [p for p in (root / "sessions").rglob("*") if p.is_file()]
        assert len(files) <= valid[0], files
        for p in files:  # a whole kvkeeper file; of a broken save only if it holds no data
            with safe_open(str(p), "np") as f:
                meta = f.metadata()
                # From the header: numpy cannot hold a bf16 tensor (one such
                # save came out of the examples under Python 3.10).
                sizes = [math.prod(f.get_slice(k).get_shape()) for k in f.keys()]
            assert meta["kvkeeper.format"], meta
            assert meta["kvkeeper.model"] != "fuzz" or not any(sizes), (meta, sizes)
        assert rss_kib(proc.pid) < rss0 + 200 * 1024, (rss0, rss_kib(proc.pid))
    finally:
        s.close(linger=0)
        ctx.term()
        assert stop_process(proc) == 0


# ------------------------------------------------------------------ hostile names

def test_hostile_ids_stay_inside_the_root_and_apart(client: Client, daemon: RunningDaemon) -> None:
    ids = ["../x", "../../etc/passwd", "/abs", "a\0b", ".", "..", "~", "Foo", "foo",
           "\u00e9", "e\u0301", "a/b", "a b", "a_b", "_41", "A", "-", "x" * 1024]
    for i, cid in enumerate(ids):
        assert client.save(FP, cid, filled(0.1, i), [i]), cid
    with pytest.raises(ValueError, match="limit is 1024"):
        client.save(FP, "x" * 10_000, filled(0.1, 0), [0])
    assert client.flush(timeout=WAIT)
    files = sorted(p for p in daemon.root.rglob("*.safetensors"))
    assert len(files) == len(ids)
    assert all(p.resolve().is_relative_to(daemon.root.resolve()) for p in files)
    assert all(len(p.name) < 255 for p in files)
    for i, cid in enumerate(ids):
        got = client.load(FP, cid)
        assert got is not None and got.token_ids == [i] and got.cache_id == cid


def test_hostile_class_names_import_nothing(client: Client, daemon: RunningDaemon) -> None:
    """A file naming os.system (or mlx_lm.modelsX) as its cache class is a miss;
    nothing outside mlx_lm.models / mlx_vlm.models is imported."""
    import json

    from kvkeeper.protocol.safetensors import LAYERS_KEY

    assert client.save(FP, "evil", filled(0.1, 1), [1]) and client.flush(timeout=WAIT)
    path = entry_path(daemon.root, "evil")
    for module, cls in [("os", "system"), ("mlx_lm.modelsX.y", "KVCache"),
                        ("subprocess", "Popen"), ("mlx_lm.models.cache", "__class__")]:
        data = bytearray(path.read_bytes())
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + n])
        layers = json.loads(header["__metadata__"][LAYERS_KEY])
        layers["layers"][0]["module"], layers["layers"][0]["class"] = module, cls
        header["__metadata__"][LAYERS_KEY] = json.dumps(layers)
        raw = json.dumps(resealed(header)).encode()
        raw += b" " * (-(8 + len(raw)) % 8)
        evil = path.with_name("evil-copy.safetensors")
        evil.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(data[8 + n :]))
        before = set(sys.modules)
        with pytest.raises(CacheFileError, match="module|class"):
            kvkeeper.read_cache_file(evil)
        assert set(sys.modules) - before == set(), (module, set(sys.modules) - before)


def test_a_layers_description_that_disagrees_with_the_tensors_is_refused(
    client: Client, daemon: RunningDaemon
) -> None:
    """The layer description names each tensor with its dtype and shape; a file
    whose description says otherwise than its tensor table is not rebuilt."""
    import json

    from kvkeeper.protocol.safetensors import LAYERS_KEY

    assert client.save(FP, "odd", filled(0.1, 1), [1]) and client.flush(timeout=WAIT)
    path = entry_path(daemon.root, "odd")
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    saved = header["__metadata__"][LAYERS_KEY]
    for change, said in (({"shape": [1, 8, 1, 128]}, r"BF16 \[1, 8, 1, 128\]"),
                         ({"dtype": "F16"}, r"F16 \[1, 8, \d+, 128\]")):
        layers = json.loads(saved)
        layers["layers"][1]["state"]["items"][0].update(change)
        header["__metadata__"][LAYERS_KEY] = json.dumps(layers)
        raw = json.dumps(resealed(header)).encode()
        odd = path.with_name("odd-copy.safetensors")
        odd.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n :])
        for verify in (False, True):
            with pytest.raises(CacheFileError,
                               match=r"layer 1\.state\.0: tensor 't2' is BF16 \[1, 8, \d+, 128\], "
                                     rf"expected {said}$"):
                kvkeeper.read_cache_file(odd, verify=verify)


def test_source_has_no_pickle_marshal_or_pyobj() -> None:
    # Builtin eval/exec only: methods such as nn.Module.eval() are fine.
    pattern = re.compile(r"\b(pickle|marshal|cPickle|dill|shelve)\b|recv_pyobj|send_pyobj"
                         r"|(?<![.\w])(eval|exec)\(")
    offenders = []
    for path in Path(kvkeeper.__file__).parent.rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if pattern.search(code):
                offenders.append(f"{path}:{n}: {line.strip()}")
    assert offenders == []


# ------------------------------------------------------------------ local security

def test_files_and_dirs_are_private(client: Client, daemon: RunningDaemon) -> None:
    assert client.save(FP, "p", filled(0.1, 1), [1]) and client.flush(timeout=WAIT)
    for d in (daemon.root, daemon.root / "sessions", daemon.socket.parent,
              entry_path(daemon.root, "p").parent):
        assert os.stat(d).st_mode & 0o777 == 0o700, d
    assert os.stat(entry_path(daemon.root, "p")).st_mode & 0o777 == 0o600
    assert os.stat(daemon.socket).st_mode & 0o077 == 0


def test_a_socket_in_a_home_directory_others_may_read_is_sent_elsewhere(
        short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The advice was "chmod 700 it": of the user's home directory."""
    from kvkeeper.config import ConfigError

    home = short_dir / "home"
    home.mkdir(mode=0o755)
    home.chmod(0o755)
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(ConfigError, match="open to group or others") as refused:
        start_daemon(short_dir / "r1", home / "kv.sock")
    assert "chmod" not in str(refused.value)
    own = home / ".kvkeeper"
    assert f"a directory of its own inside it instead (e.g. '{own}'" in str(refused.value)
    start_daemon(short_dir / "r1", own / "kv.sock").stop()


def test_a_symlink_to_a_shared_directory_gets_the_shared_directory_s_advice(
        short_dir: Path) -> None:
    """macOS's /tmp is a symlink to /private/tmp: --socket /tmp/kv.sock was
    refused as a symlink, without the advice /private/tmp/kv.sock gets (a
    directory of its own inside it), which works through the link."""
    from kvkeeper.config import ConfigError

    shared = short_dir / "ptmp"
    shared.mkdir()
    shared.chmod(0o1777)
    link = short_dir / "tmp"
    link.symlink_to(shared)
    with pytest.raises(ConfigError, match="is a symlink; refusing to follow it") as refused:
        start_daemon(short_dir / "r1", link / "kv.sock")
    own = link / f"kvkeeper-{os.getuid()}"
    assert f"; use a directory of its own inside it instead (e.g. '{own}'" in str(refused.value)
    start_daemon(short_dir / "r1", own / "kv.sock").stop()
    with pytest.raises(ConfigError, match="is a symlink; refusing to follow it") as refused:
        start_daemon(link, short_dir / "run" / "kv.sock")
    assert "in a directory of its own that outlives a reboot" in str(refused.value)
    # A link to a directory of one's own is refused as before, with no advice.
    mine = short_dir / "mine"
    mine.mkdir(mode=0o700)
    (short_dir / "to-mine").symlink_to(mine)
    with pytest.raises(ConfigError) as refused:
        start_daemon(short_dir / "r1", short_dir / "to-mine" / "kv.sock")
    assert str(refused.value).endswith("is a symlink; refusing to follow it"), refused.value


def test_refuses_socket_dirs_others_can_use(short_dir: Path) -> None:
    need_linux_root()
    from kvkeeper.config import ConfigError

    open_dir = short_dir / "open"
    open_dir.mkdir()
    open_dir.chmod(0o770)
    with pytest.raises(ConfigError, match="open to group or others") as refused:
        start_daemon(short_dir / "r1", open_dir / "kv.sock")
    assert "(chmod 700 it); on a file system that keeps no modes, such as exFAT or FAT, use a "\
        "directory on another" in str(refused.value)
    # A directory every user shares, as /tmp: not to be chmod-ed, but to hold
    # a directory of the daemon's own.
    shared = short_dir / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    with pytest.raises(ConfigError, match="open to group or others") as refused:
        start_daemon(short_dir / "r1", shared / "kv.sock")
    assert "chmod" not in str(refused.value)
    own = shared / f"kvkeeper-{os.getuid()}"
    assert f"a directory of its own inside it instead (e.g. '{own}'" in str(refused.value)
    start_daemon(short_dir / "r1", own / "kv.sock").stop()
    # A store there would go at the next boot: not "a directory inside it".
    with pytest.raises(ConfigError, match="open to group or others") as refused:
        start_daemon(shared, short_dir / "run" / "kv.sock")
    assert "inside it" not in str(refused.value)
    assert "in a directory of its own that outlives a reboot (the default root is" \
        in str(refused.value)
    os.chown(shared, pwd.getpwnam("nobody").pw_uid, -1)  # as /tmp, root's, is to a user
    with pytest.raises(ConfigError, match="owned by uid") as refused:
        start_daemon(short_dir / "r1", shared / "kv.sock")
    assert f"a directory of its own inside it instead (e.g. '{own}'" in str(refused.value)
    theirs = short_dir / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, pwd.getpwnam("nobody").pw_uid, -1)
    with pytest.raises(ConfigError, match="owned by uid") as refused:
        start_daemon(theirs, short_dir / "run" / "kv.sock")
    # Not "a directory of its own inside it": nothing can be made there.
    assert "inside it" not in str(refused.value)
    link = short_dir / "link"
    link.symlink_to(short_dir / "run", target_is_directory=True)
    (short_dir / "run").mkdir(mode=0o700)
    with pytest.raises(ConfigError, match="symlink"):
        start_daemon(short_dir / "r2", link / "kv.sock")


def test_messages_from_another_user_are_never_processed(short_dir: Path) -> None:
    need_linux_root()
    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock")
    try:
        # Open the path to everyone so that only the daemon's own checks stand
        # between the other user and the socket.
        short_dir.chmod(0o711)
        rd.socket.parent.chmod(0o711)
        rd.socket.chmod(0o777)
        nobody = pwd.getpwnam("nobody")
        # The child imports as root (the interpreter lives under /root), then
        # drops to nobody before it touches the socket.
        script = textwrap.dedent(f"""
            import os, zmq, sys
            from kvkeeper.protocol import messages as m
            os.setgroups([])
            os.setgid({nobody.pw_gid})
            os.setuid({nobody.pw_uid})
            assert os.getuid() == {nobody.pw_uid}
            s = zmq.Context().socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect("ipc://{rd.socket}")
            s.send(m.encode(m.SaveBegin(v=1, save=1, model="fp", cache_id="intruder",
                   tensors=[m.TensorSpec("t", "U8", [4])])))
            s.send_multipart([m.encode(m.SaveData(v=1, save=1, frames=1)), b"1234"])
            s.send(m.encode(m.Ping(v=1, req=1)))
            print("answered" if s.poll(2000) else "silence")
        """)
        out = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=WAIT,
            cwd="/", env={**os.environ, "PYTHONPATH": str(Path(kvkeeper.__file__).parent.parent)},
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "silence"
        with Client(rd.socket, timeout=WAIT) as kv:
            stats = kv.stats()
        assert stats["saves_received"] == 0
        assert not os.path.exists(rd.root / "sessions" / "fp")
    finally:
        short_dir.chmod(0o700)
        rd.stop()


def test_planted_symlinks_are_not_followed(client: Client, daemon: RunningDaemon,
                                           short_dir: Path) -> None:
    outside = short_dir / "outside"
    outside.mkdir()
    target = outside / "victim.txt"
    target.write_text("keep me")
    # At the final path: the rename replaces the link, never writes through it.
    assert client.save(FP, "k", filled(0.1, 1), [1]) and client.flush(timeout=WAIT)
    final = entry_path(daemon.root, "k")
    final.unlink()
    final.symlink_to(target)
    assert client.save(FP, "k", filled(0.1, 2), [2]) and client.flush(timeout=WAIT)
    assert target.read_text() == "keep me" and not final.is_symlink()
    # At a model directory: the save fails, nothing lands outside the root.
    model_dir = entry_path(daemon.root, "k", model="planted").parent
    model_dir.symlink_to(outside, target_is_directory=True)
    assert client.save("planted", "k", filled(0.1, 3), [3])
    assert client.flush(timeout=WAIT) is False
    assert sorted(p.name for p in outside.iterdir()) == ["victim.txt"]


def test_second_daemon_cannot_steal_the_socket(short_dir: Path) -> None:
    sock = short_dir / "run" / "kv.sock"
    proc = serve_process(short_dir / "root1", sock)
    try:
        other = subprocess.run(
            [sys.executable, "-m", "kvkeeper.cli", "serve", "--root", str(short_dir / "root2"),
             "--socket", str(sock)], capture_output=True, text=True, timeout=WAIT)
        assert other.returncode == 2 and f"pid {proc.pid}" in other.stderr
        assert ping(sock)
        with Client(sock, timeout=WAIT) as kv:
            assert kv.ping().pid == proc.pid
    finally:
        assert stop_process(proc) == 0


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_failed_saves_tensor_table_is_let_go(short_dir: Path) -> None:
    """A save's decoded tensor table can be many times its bytes on the wire,
    and the pending budget counts none of it. A failed save let go of its
    data and metadata but kept the table for as long as its client sent
    nothing else (8 clients, 65,536 long names each: 280 MB held)."""
    sock = short_dir / "run" / "s"
    proc = serve_process(short_dir / "root", sock, "--stall-timeout", "1",
                         "--min-write-interval", "0", "--max-disk-bytes", "0",
                         "--min-free-bytes", "0")
    ctx = zmq.Context()
    try:
        before = rss_kib(proc.pid) / 1024
        specs = [m.TensorSpec(f"n{i:0254d}", "U8", [1]) for i in range(65536)]
        peers = [dealer(ctx, sock) for _ in range(8)]
        for i, s in enumerate(peers):  # begun, then silent: each fails at its stall timeout
            s.send(m.encode(m.SaveBegin(v=m.PROTOCOL_VERSION, save=1, model="fp",
                                        cache_id=f"c{i}", tensors=specs)))
        del specs
        stats = dealer(ctx, sock)
        deadline = time.monotonic() + 4 * WAIT
        while True:
            stats.send(m.encode(m.GetStats(v=m.PROTOCOL_VERSION, req=1)))
            counters = m.decode_reply(stats.recv()).counters  # type: ignore[union-attr]
            if counters.get("saves_failed", 0) == 8:
                break
            assert time.monotonic() < deadline, counters
            time.sleep(0.2)
        held = rss_kib(proc.pid) / 1024 - before
        assert held < 100, f"{held:.0f} MiB more than before the saves, all of them failed"
    finally:
        ctx.destroy(linger=0)
        stop_process(proc)


def test_a_live_saves_tensor_table_counts_against_the_memory_budget(short_dir: Path) -> None:
    """A save's decoded tensor table (65,536 long names: 33 MB in memory for
    17 on the wire) was not counted while the save lived: 16 such saves,
    each kept alive by a byte now and then, held 630 MB of a daemon given
    16 MiB. Counted, the second one finds no room."""
    sock = short_dir / "run" / "s"
    proc = serve_process(short_dir / "root", sock, "--max-pending-bytes", str(64 * 2**20),
                         "--stall-timeout", "30")
    ctx = zmq.Context()
    try:
        specs = [m.TensorSpec(f"n{i:0254d}", "U8", [1]) for i in range(65536)]
        begin = [m.encode(m.SaveBegin(v=m.PROTOCOL_VERSION, save=1, model="fp",
                                      cache_id=f"c{i}", tensors=specs)) for i in range(2)]
        del specs
        first, second, stats = (dealer(ctx, sock) for _ in range(3))
        first.send(begin[0])
        deadline = time.monotonic() + WAIT
        while True:
            stats.send(m.encode(m.GetStats(v=m.PROTOCOL_VERSION, req=1)))
            got = m.decode_reply(stats.recv())
            if got.counters.get("saves_received", 0) == 1:  # type: ignore[union-attr]
                break
            assert time.monotonic() < deadline, got
            time.sleep(0.05)
        assert got.counters["pending_bytes"] > 30e6, got.counters  # type: ignore[union-attr]
        second.send(begin[1])
        refused = m.decode_reply(second.recv())
        assert isinstance(refused, m.SaveRefused) and refused.code == "busy", refused
    finally:
        ctx.destroy(linger=0)
        stop_process(proc)


def test_a_peer_that_keeps_the_socket_busy_holds_up_no_other_client(short_dir: Path) -> None:
    """One peer sending costly headers (65,536 tensors, refused for a
    duplicate name) as fast as the daemon reads them: pyzmq handed over each
    waiting message without going back to the event loop, so no task ran (the
    writer, the flush answers, SIGTERM's drain) and another client's flush
    waited for the flood to end."""
    import threading

    sock = short_dir / "run" / "s"
    proc = serve_process(short_dir / "root", sock, "--min-write-interval", "0")
    stop, sent = threading.Event(), [0]

    def flood() -> None:
        ctx = zmq.Context()
        s = dealer(ctx, sock)
        s.setsockopt(zmq.SNDHWM, 4)
        specs = [m.TensorSpec(f"t{i}", "F32", [0]) for i in range(65535)]
        header = zmq.Frame(m.encode(m.SaveBegin(v=V, save=1, model="fp", cache_id="x",
                                                tensors=[*specs, specs[0]])))
        try:
            while not stop.is_set():
                if s.poll(100, zmq.POLLOUT):
                    s.send(header, copy=False)
                    sent[0] += 1
                while s.poll(0):
                    s.recv()
        finally:
            ctx.destroy(linger=0)

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    try:
        deadline = time.monotonic() + WAIT
        while sent[0] < 20:
            assert time.monotonic() < deadline and flooder.is_alive(), "the flood did not begin"
            time.sleep(0.02)
        with Client(sock, timeout=WAIT) as kv:
            assert kv.save("fp", "a", filled(0.05, 1), [1])
            assert kv.flush(timeout=WAIT) is True  # before: DaemonTimedOut, the flood on
            assert flooder.is_alive() and not stop.is_set()
    finally:
        stop.set()
        flooder.join(WAIT)
        stop_process(proc)


def test_a_save_header_that_does_not_decode_is_not_built_whole(short_dir: Path) -> None:
    """Its save number was read back as any object: a 30 MiB array of empty
    maps there took the daemon 4.4 s and 2.3 GiB more. It is still counted
    as the sender's refused save."""
    sock = short_dir / "run" / "s"
    proc = serve_process(short_dir / "root", sock)
    ctx = zmq.Context()
    try:
        s = dealer(ctx, sock)
        s.send(msgspec.msgpack.encode({"op": "save", "v": V, "save": [{}] * 30_000_000}))
        reply = m.decode_reply(s.recv())
        assert isinstance(reply, m.Error) and reply.code == "malformed", reply
        s.send(m.encode(m.Flush(v=V, req=1)))
        flushed = m.decode_reply(s.recv())
        assert isinstance(flushed, m.Flushed) and flushed.failed == 1, flushed
        status = Path(f"/proc/{proc.pid}/status").read_text()
        peak_mib = int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 1024  # type: ignore[union-attr]
        assert peak_mib < 600, f"the daemon's peak: {peak_mib:.0f} MiB"
    finally:
        ctx.destroy(linger=0)
        stop_process(proc)


def test_the_peer_uid_is_read_from_a_unix_socket_itself() -> None:
    """Where libzmq's Peer-Address names no uid (macOS: empty for a unix
    socket), the daemon asks the connection's socket (LOCAL_PEERCRED there,
    SO_PEERCRED here): before, every uid was let in. This platform's branch,
    on a real socket pair; anything but a unix socket tells nothing."""
    import socket

    from kvkeeper.daemon.server import _socket_peer_uid

    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        assert _socket_peer_uid(a.fileno()) == os.getuid()
    r, w = os.pipe()
    try:
        assert _socket_peer_uid(r) is None
    finally:
        os.close(r)
        os.close(w)
