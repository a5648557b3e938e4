"""The numba kernels' cache: one directory per version of ``kernels/``'s sources, whatever the checkout's path."""

from __future__ import annotations

import shutil
from pathlib import Path

import numba
import pytest

pytest.importorskip("numba")

from dynemb.kernels import numba_cache, numba_index  # noqa: E402  (after the skip)


def test_the_key_changes_with_any_kernel_file(tmp_path):
    sources = tmp_path / "kernels"
    shutil.copytree(numba_cache._HERE, sources, ignore=shutil.ignore_patterns("__pycache__"))
    assert numba_cache.cache_key(sources) == numba_cache.cache_key()  # the path does not matter
    helper = sources / "numba_math.py"  # no cached kernel in it; the kernels that inline it are elsewhere
    helper.write_text(helper.read_text() + "\n# a change\n")
    assert numba_cache.cache_key(sources) != numba_cache.cache_key()


def test_kernels_of_this_package_are_cached_under_the_key():
    directory = Path(numba_index.radix_sort._cache._cache_path)
    if numba.config.CACHE_DIR:
        pytest.skip("NUMBA_CACHE_DIR is set: numba's own locator applies")
    assert directory == numba_cache.cache_root() / numba_cache.cache_key()
    assert directory.is_dir()


def test_other_files_and_a_users_directory_go_to_numbas_locators(monkeypatch, tmp_path):
    def f(x):
        return x

    locator = numba_cache._SourcesLocator
    assert locator.from_function(f, __file__) is None
    assert locator.from_function(numba_index.radix_sort.py_func, numba_index.__file__) is not None
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path))
    assert locator.from_function(numba_index.radix_sort.py_func, numba_index.__file__) is None
