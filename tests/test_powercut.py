"""A simulated power cut: the store on a loop-mounted ext4 image, the image
copied while mounted right after ``flush()`` returns, the copy checked with
fsck and mounted read-only. A copy taken that way holds only what the file
system had sent to its device: what fsync and the directory fsync forced out.

The negative controls (the daemon with its file fsync or its directory fsync
switched off by a test-only hook) must lose the save in the copy. What would
write it out anyway is kept out of the few seconds the test takes: the image
is mounted with a 60 s journal commit interval and without ext4's
auto_da_alloc (which writes a file's data out when it is renamed over
another), and the kernel writes dirty pages back only once they are
vm.dirty_expire_centisecs old (30 s by default; checked to be 10 s or more).
A `sync` run by another process during the few seconds would defeat a
control: on a machine shared with such a process, it fails."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kvkeeper.client.client import Client
from kvkeeper.daemon.faults import ENV

from .conftest import WAIT, serve_process
from .faultkit import FP, entry_path, filled, need_linux_root, run, version_of


def cut_power(short_dir: Path, hook: str | None) -> tuple[bool, str]:
    """Save once to a fresh ext4 image, copy it as a power cut would leave it;
    returns (the saved version is in the copy, what was seen)."""
    img, mnt, copy, cmnt = (short_dir / n for n in ("disk.img", "mnt", "copy.img", "cmnt"))
    for d in (mnt, cmnt):
        d.mkdir(mode=0o700, exist_ok=True)
    run("truncate", "-s", "64M", str(img))
    run("mkfs.ext4", "-q", "-F", str(img))
    run("mount", "-o", "loop,commit=60,noauto_da_alloc", str(img), str(mnt))
    try:
        mnt.chmod(0o700)
        root = mnt / "root"
        # A 64 MiB disk: keeping the default 5 GiB free is refused at start.
        proc = serve_process(root, short_dir / "run" / "kv.sock", "--min-free-bytes", "0",
                             env={ENV: hook} if hook else None)
        try:
            with Client(short_dir / "run" / "kv.sock", timeout=WAIT) as kv:
                assert kv.save(FP, "cut", filled(2, 5), [5])
                assert kv.flush(timeout=WAIT)
                shutil.copyfile(img, copy)  # the power goes out here
        finally:
            proc.kill()
            proc.wait(WAIT)
    finally:
        run("umount", str(mnt))
    fsck = subprocess.run(["e2fsck", "-fy", str(copy)], capture_output=True, timeout=60)
    assert fsck.returncode in (0, 1), fsck.stdout  # 1: errors corrected (journal replay)
    run("mount", "-o", "loop,ro", str(copy), str(cmnt))
    try:
        path = entry_path(cmnt / "root", "cut")
        if not path.exists():
            return False, "file missing"
        try:
            return version_of(path) == 5, "present"
        except Exception as exc:  # noqa: BLE001 - any unreadable state is loss
            return False, f"unreadable: {exc}"
    finally:
        run("umount", str(cmnt))


def test_power_cut_after_flush_keeps_the_save(short_dir: Path) -> None:
    need_linux_root()
    kept, seen = cut_power(short_dir, None)
    assert kept, seen


@pytest.mark.parametrize("hook", ["no_fsync=1", "no_dir_fsync=1"])
def test_power_cut_negative_controls(short_dir: Path, hook: str) -> None:
    need_linux_root()
    expire = int(Path("/proc/sys/vm/dirty_expire_centisecs").read_text())
    assert expire >= 1000, f"vm.dirty_expire_centisecs is {expire}: the kernel may write " \
                           f"the save out within the test, and the control would show nothing"
    kept, seen = cut_power(short_dir, hook)
    assert not kept, f"without {hook.split('=')[0][3:]} the save survived the cut: {seen}"
