"""The policy file watcher (gateway/watch.py) against real files: edits, renames, ConfigMap swaps, vanishing.

Most tests call `check()` directly, so they are deterministic and need no sleeps; one runs the `run()`
loop with a short interval under a timeout.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import pytest

from gateway.watch import PolicyWatcher

V1 = "version: 1\ntenants: []\n"
V2 = "version: 1\nrollouts: []\n"  # a different text of another length
V1_SAME_SIZE = V1.replace("[]", "()")  # different bytes, same length


class Calls:
    """An on_change that counts its calls."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> None:
        self.count += 1


@pytest.fixture
def policy_file(tmp_path: Path) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(V1)
    return path


def test_no_change_no_callback(policy_file: Path) -> None:
    calls = Calls()
    watcher = PolicyWatcher(policy_file, calls)
    assert calls.count == 0  # the initial content is not a change
    assert [watcher.check() for _ in range(3)] == [False, False, False]
    assert calls.count == 0


def test_in_place_rewrite_fires_once(policy_file: Path) -> None:
    calls = Calls()
    watcher = PolicyWatcher(policy_file, calls)
    inode = policy_file.stat().st_ino
    policy_file.write_text(V2)
    assert policy_file.stat().st_ino == inode
    assert watcher.check() is True
    assert watcher.check() is False
    assert calls.count == 1


def test_same_size_rewrite_with_the_same_mtime_is_seen(policy_file: Path) -> None:
    calls = Calls()
    watcher = PolicyWatcher(policy_file, calls)
    before = policy_file.stat()
    policy_file.write_text(V1_SAME_SIZE)
    os.utime(policy_file, ns=(before.st_atime_ns, before.st_mtime_ns))  # as a coarse mtime clock would
    after = policy_file.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    assert watcher.check() is True
    assert calls.count == 1


def test_rewrite_with_identical_content_does_not_fire(policy_file: Path) -> None:
    calls = Calls()
    watcher = PolicyWatcher(policy_file, calls)
    policy_file.write_text(V1)
    os.utime(policy_file, ns=(1, 10**18))  # a different mtime: stat changed, content did not
    assert watcher.check() is False
    assert calls.count == 0


def test_an_unchanged_settled_file_is_not_read_again(policy_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    os.utime(policy_file, ns=(1, 10**18))  # modified long before the watcher's first read
    watcher = PolicyWatcher(policy_file, Calls())

    def no_reads(self: Path) -> bytes:
        raise AssertionError(f"read {self} although its stat did not change")

    monkeypatch.setattr(Path, "read_bytes", no_reads)
    assert watcher.check() is False


def test_atomic_rename_fires(policy_file: Path) -> None:
    calls = Calls()
    watcher = PolicyWatcher(policy_file, calls)
    tmp = policy_file.with_name(".policy.yaml.tmp")
    tmp.write_text(V2)
    os.replace(tmp, policy_file)
    assert watcher.check() is True
    assert watcher.check() is False
    assert calls.count == 1


def _configmap_version(mount: Path, stamp: str, text: str) -> str:
    """A kubelet-style timestamped data directory holding policy.yaml; returns its name."""
    name = f"..{stamp}"
    (mount / name).mkdir()
    (mount / name / "policy.yaml").write_text(text)
    return name


def test_configmap_symlink_swap_fires_once(tmp_path: Path) -> None:
    mount = tmp_path / "config"
    mount.mkdir()
    old = _configmap_version(mount, "2026_11_29_10_00_00.123", V1)
    os.symlink(old, mount / "..data")
    os.symlink("..data/policy.yaml", mount / "policy.yaml")
    calls = Calls()
    watcher = PolicyWatcher(mount / "policy.yaml", calls)
    assert watcher.check() is False

    # The kubelet's update: a new timestamped dir, `..data_tmp` -> it renamed over `..data`, old dir removed.
    new = _configmap_version(mount, "2026_11_29_10_05_00.456", V2)
    os.symlink(new, mount / "..data_tmp")
    os.replace(mount / "..data_tmp", mount / "..data")
    (mount / old / "policy.yaml").unlink()
    (mount / old).rmdir()

    assert (mount / "policy.yaml").read_text() == V2
    assert watcher.check() is True
    assert watcher.check() is False
    assert calls.count == 1


def test_configmap_swap_to_the_same_content_does_not_fire(tmp_path: Path) -> None:
    mount = tmp_path / "config"
    mount.mkdir()
    os.symlink(_configmap_version(mount, "2026_11_29_10_00_00.123", V1), mount / "..data")
    os.symlink("..data/policy.yaml", mount / "policy.yaml")
    calls = Calls()
    watcher = PolicyWatcher(mount / "policy.yaml", calls)
    os.symlink(_configmap_version(mount, "2026_11_29_10_05_00.456", V1), mount / "..data_tmp")
    os.replace(mount / "..data_tmp", mount / "..data")
    assert watcher.check() is False
    assert calls.count == 0


def test_vanished_file_does_not_fire_until_back_with_new_content(
    policy_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    calls = Calls()
    watcher = PolicyWatcher(policy_file, calls)
    policy_file.unlink()
    with caplog.at_level(logging.WARNING, logger="gateway.watch"):
        assert [watcher.check() for _ in range(3)] == [False, False, False]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "missing or unreadable" in warnings[0].getMessage()
    policy_file.write_text(V2)
    assert watcher.check() is True
    assert watcher.check() is False
    assert calls.count == 1


def test_vanished_file_back_with_the_same_content_does_not_fire(policy_file: Path) -> None:
    calls = Calls()
    watcher = PolicyWatcher(policy_file, calls)
    policy_file.unlink()
    assert watcher.check() is False
    policy_file.write_text(V1)
    assert watcher.check() is False
    policy_file.write_text(V2)  # a real change afterwards still fires
    assert watcher.check() is True
    assert calls.count == 1


def test_file_missing_at_start_fires_when_it_appears(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    calls = Calls()
    watcher = PolicyWatcher(path, calls)
    assert watcher.check() is False
    path.write_text(V1)
    assert watcher.check() is True
    assert calls.count == 1


def test_interval_must_be_positive(policy_file: Path) -> None:
    with pytest.raises(ValueError, match="interval_s"):
        PolicyWatcher(policy_file, Calls(), interval_s=0)


def test_run_calls_back_and_survives_a_failing_callback(policy_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    seen: list[str] = []

    def on_change() -> None:
        seen.append(policy_file.read_text())
        if len(seen) == 1:
            raise RuntimeError("reload blew up")

    async def scenario() -> None:
        watcher = PolicyWatcher(policy_file, on_change, interval_s=0.05)
        task = asyncio.create_task(watcher.run())
        try:
            policy_file.write_text(V2)
            while len(seen) < 1:
                await asyncio.sleep(0.01)
            policy_file.write_text(V1)
            while len(seen) < 2:
                await asyncio.sleep(0.01)
            assert not task.done()  # the exception did not end the loop
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    with caplog.at_level(logging.ERROR, logger="gateway.watch"):
        asyncio.run(asyncio.wait_for(scenario(), timeout=10))
    assert seen == [V2, V1]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None
    assert "reload blew up" in str(errors[0].exc_info[1])
