"""The shared file mechanisms (sft_tokenize/files.py): a replaced file is whole or untouched, a built directory
appears whole or not at all, and the lock and its probe hold across real processes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sft_tokenize.files import atomic_path, atomic_write, built_directory, is_locked


@pytest.mark.parametrize("durable", [True, False])
def test_an_atomic_write_replaces_the_file_and_leaves_nothing_beside_it(tmp_path, durable):
    target = tmp_path / "book.json"
    target.write_text("old")
    atomic_write(target, '{"é": 1}', durable=durable)
    assert target.read_bytes() == '{"é": 1}'.encode()
    atomic_write(target, b"\x00\x01", durable=durable)
    assert target.read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["book.json"]


def test_a_write_that_fails_before_the_rename_leaves_the_old_file_whole_and_no_temp_file(tmp_path):
    target = tmp_path / "shard.arrow"
    target.write_bytes(b"old bytes")
    with pytest.raises(RuntimeError, match="cut short"), atomic_path(target) as tmp:
        tmp.write_bytes(b"half of the new")
        assert tmp.name.startswith("shard.arrow.tmp-") and tmp.parent == tmp_path
        raise RuntimeError("cut short")
    assert target.read_bytes() == b"old bytes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard.arrow"]


def test_a_rename_that_fails_leaves_no_temp_file(tmp_path):
    target = tmp_path / "taken"
    (target / "inside").mkdir(parents=True)  # a directory cannot be replaced by a file
    with pytest.raises(OSError):
        atomic_write(target, b"data")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
    assert (target / "inside").is_dir()


def test_a_built_directory_replaces_an_existing_one_whole(tmp_path):
    final = tmp_path / "cache"
    final.mkdir()
    (final / "old.txt").write_text("old")
    with built_directory(final, tmp_path / ".cache.building", tmp_path / ".cache.stale") as building:
        assert building.name.startswith(".cache.building-") and building.parent == tmp_path
        assert not final.joinpath("new.txt").exists()  # nothing is visible until the block ends
        (building / "new.txt").write_text("new")
    assert sorted(p.name for p in final.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]


def test_a_failed_built_directory_leaves_no_directory_and_the_old_target_intact(tmp_path):
    final = tmp_path / "cache"
    final.mkdir()
    (final / "old.txt").write_text("old")
    with pytest.raises(RuntimeError, match="killed"), \
            built_directory(final, tmp_path / ".cache.building", tmp_path / ".cache.stale") as building:
        (building / "new.txt").write_text("new")
        raise RuntimeError("killed mid-build")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]
    assert (final / "old.txt").read_text() == "old"
    with pytest.raises(RuntimeError), built_directory(tmp_path / "fresh", tmp_path / "fresh.b", tmp_path / "x"):
        raise RuntimeError("no target before, none after")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]


HOLDER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from sft_tokenize.files import locked
    with locked(Path(sys.argv[1]), shared=sys.argv[2] == "shared"):
        print("held", flush=True)
        sys.stdin.readline()  # held until the test closes our stdin
""")

TAKER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from sft_tokenize.files import locked
    with locked(Path(sys.argv[1])):
        print(time.monotonic(), flush=True)
""")


def hold(lock_file: Path, mode: str = "exclusive") -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock_file), mode], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.mark.parametrize("mode", ["exclusive", "shared"])
def test_the_lock_excludes_a_second_process_and_the_probe_sees_it(tmp_path, mode):
    lock_file = tmp_path / "run.lock"
    assert not is_locked(lock_file) and not lock_file.exists()  # the probe never creates the file
    holder = hold(lock_file, mode)
    try:
        assert is_locked(lock_file)
        taker = subprocess.Popen([sys.executable, "-c", TAKER, str(lock_file)], stdout=subprocess.PIPE, text=True)
        time.sleep(1.5)
        assert taker.poll() is None, "a second process took the lock while the first held it"
        released = time.monotonic()
        holder.stdin.close()
        holder.wait(timeout=30)
        took = float(taker.communicate(timeout=30)[0])
        assert took >= released
    finally:
        holder.kill()
        holder.wait()
    assert not is_locked(lock_file)


def test_shared_holders_do_not_exclude_each_other(tmp_path):
    lock_file = tmp_path / "gc.lock"
    first = hold(lock_file, "shared")
    try:
        second = hold(lock_file, "shared")  # would hang at "held" if shared locks excluded each other
        second.stdin.close()
        second.wait(timeout=30)
        assert is_locked(lock_file)
    finally:
        first.kill()
        first.wait()
    assert not is_locked(lock_file)


CHURN = textwrap.dedent("""
    import sys
    from pathlib import Path
    from sft_tokenize.files import locked
    lock_file, counter = Path(sys.argv[1]), Path(sys.argv[2])
    for _ in range(int(sys.argv[3])):
        with locked(lock_file, remove=True):
            assert lock_file.exists(), "held a lock whose file is gone"
            count = int(counter.read_text())  # a read-modify-write: two holders at once would lose counts
            counter.write_text(str(count + 1))
""")


def test_a_lock_removed_on_release_still_excludes_every_other_process(tmp_path):
    """Processes that lock, remove the file and lock again as fast as they can: none ever holds the lock beside
    another (a lost count) or holds a file no longer at the path, and the last one out leaves no file."""
    lock_file, counter = tmp_path / "v1.run.lock", tmp_path / "count"
    counter.write_text("0")
    rounds = 300
    churners = [subprocess.Popen([sys.executable, "-c", CHURN, str(lock_file), str(counter), str(rounds)])
                for _ in range(3)]
    assert [p.wait(timeout=120) for p in churners] == [0, 0, 0]
    assert int(counter.read_text()) == 3 * rounds
    assert not lock_file.exists()


def test_a_removed_lock_file_stays_while_another_process_holds_it(tmp_path):
    from sft_tokenize.files import locked

    lock_file = tmp_path / "v1.lock"
    holder = hold(lock_file, "shared")
    try:
        with locked(lock_file, shared=True, remove=True):
            assert is_locked(lock_file)
        assert lock_file.exists() and is_locked(lock_file)  # the other holder's file is not pulled from under it
    finally:
        holder.kill()
        holder.wait()
    with locked(lock_file, shared=True, remove=True):
        pass
    assert not lock_file.exists()  # the last holder out removes it
    with locked(lock_file):
        pass
    assert lock_file.exists()  # without `remove`, a lock file stays as before
