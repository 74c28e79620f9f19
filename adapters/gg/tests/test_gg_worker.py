"""The worker's process handling: a thunk's function runs at the lowest CPU priority, the
worker process itself does not."""

from __future__ import annotations

import os

from pocketflow_gg.worker import FUNCTION_NICENESS, _run_function


def test_a_function_runs_at_the_thunk_niceness_and_the_worker_keeps_its_own() -> None:
    before = os.getpriority(os.PRIO_PROCESS, 0)
    result = _run_function(["sh", "-c", "cut -d' ' -f19 /proc/self/stat"], capture_output=True,
                           text=True, check=True, timeout=30)
    assert int(result.stdout) == max(before, FUNCTION_NICENESS)
    assert os.getpriority(os.PRIO_PROCESS, 0) == before


def test_the_value_cache_keeps_small_values_and_drops_the_least_recently_used() -> None:
    from pocketflow_gg.worker import VALUE_CACHE_ITEM_BYTES_MAX, _ValueCache

    cache = _ValueCache(bytes_max=250)
    for name in ("a", "b"):
        cache.keep(name, b"x" * 100)
    assert cache.take(["a", "z"]) == {"a": b"x" * 100}  # "a" is now the most recent
    cache.keep("c", b"y" * 100)  # over 250 bytes: "b", the least recently used, goes
    assert sorted(cache.take(["a", "b", "c"])) == ["a", "c"]
    cache.keep("big", b"z" * (VALUE_CACHE_ITEM_BYTES_MAX + 1))
    assert cache.take(["big"]) == {}


def test_the_executable_cache_lives_only_in_a_directory_this_user_alone_writes(
    tmp_path, monkeypatch
) -> None:
    import pytest
    from pocketflow_gg import worker
    from pocketflow_gg.errors import ThunkFailed

    root = tmp_path / "cache-root"
    monkeypatch.setattr(worker, "EXE_CACHE_ROOT", root)
    assert worker.exe_cache_dir() == root / "executables"
    assert root.stat().st_mode & 0o777 == 0o700
    root.chmod(0o755)  # ours, readable by others: made private again
    worker.exe_cache_dir()
    assert root.stat().st_mode & 0o777 == 0o700
    root.chmod(0o777)  # anyone could have put a file there: refused
    with pytest.raises(ThunkFailed, match="only this user"):
        worker.exe_cache_dir()
    root.chmod(0o700)
