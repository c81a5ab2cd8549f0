"""Persistent compile caches: torch.compile's artefacts kept in fastjudge's cache directory.

Inductor caches what it compiles (FX graphs, AOTAutograd graphs, generated C++/Triton code and
their binaries) under ``TORCHINDUCTOR_CACHE_DIR``, by default a directory in the system's temp
directory, which is often cleared at reboot or is private to a container's lifetime. Pointing it
at ``<fastjudge cache>/torch-compile/torch-<version>`` (the cache directory of
:func:`fastjudge.paths.cache_dir`: ``$FASTJUDGE_CACHE``, else ``$XDG_CACHE_HOME/fastjudge``, else
``~/.cache/fastjudge``) lets a later process load its compiled steps instead of compiling them
again. One directory per torch version, so an upgrade leaves the old one whole to delete.

A ``TORCHINDUCTOR_CACHE_DIR`` the user set is left alone. The variable is read when inductor
first needs its cache directory, so :func:`use_persistent_compile_cache` must run before the
first ``torch.compile`` call of the process compiles anything.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from ..paths import cache_dir

log = logging.getLogger("fastjudge")

ENV = "TORCHINDUCTOR_CACHE_DIR"


def compile_cache_dir() -> Path:
    """Where fastjudge keeps torch.compile's caches for the running torch version."""
    version = torch.__version__.split("+")[0]
    return cache_dir() / "torch-compile" / f"torch-{version}"


def use_persistent_compile_cache() -> Path:
    """Set ``TORCHINDUCTOR_CACHE_DIR`` to :func:`compile_cache_dir` unless it is set already;
    returns the directory inductor will use. A directory that cannot be created leaves
    inductor's default (logged)."""
    chosen = os.environ.get(ENV)
    if chosen:
        return Path(chosen)
    path = compile_cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.warning("fastjudge: cannot create the compile cache %s (%s); torch's default is used", path, e)
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        return Path(default_cache_dir())
    os.environ[ENV] = str(path)
    return path
