"""``backends.compile_cache``: inductor's caches in fastjudge's cache directory unless the user
chose another.

Contract from torch/_inductor/runtime/cache_dir_utils.py ``cache_dir`` (torch v2.13.0): inductor
reads ``TORCHINDUCTOR_CACHE_DIR`` each time it needs its cache directory and falls back to a
directory under the system temp directory when the variable is unset.
"""

from __future__ import annotations

import torch
from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

from fastjudge.backends.compile_cache import ENV, compile_cache_dir, use_persistent_compile_cache


def test_cache_in_the_fastjudge_cache_directory(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, "unset-below")  # recorded, so the test's changes are undone after it
    monkeypatch.delenv(ENV)
    monkeypatch.setenv("FASTJUDGE_CACHE", str(tmp_path))
    path = use_persistent_compile_cache()
    version = torch.__version__.split("+")[0]
    assert path == compile_cache_dir() == tmp_path / "torch-compile" / f"torch-{version}"
    assert path.is_dir()
    assert inductor_cache_dir() == str(path)


def test_user_choice_kept(tmp_path, monkeypatch):
    mine = tmp_path / "mine"
    monkeypatch.setenv(ENV, str(mine))
    monkeypatch.setenv("FASTJUDGE_CACHE", str(tmp_path / "fj"))
    assert use_persistent_compile_cache() == mine
    assert inductor_cache_dir() == str(mine)
    assert not (tmp_path / "fj").exists()
