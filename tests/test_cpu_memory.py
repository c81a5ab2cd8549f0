"""``backends/cpu_memory.py``: glibc's malloc thresholds set once, and left alone where the
environment already tunes malloc."""

from __future__ import annotations

import platform

import pytest

from fastjudge.backends import cpu_memory

glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not glibc, reason="mallopt thresholds are glibc's")
def test_sets_thresholds_once(monkeypatch):
    for name in cpu_memory._TUNING_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cpu_memory, "_kept", False)
    assert cpu_memory.keep_freed_memory() is True
    assert cpu_memory.keep_freed_memory() is True  # idempotent


def test_environment_tuning_wins(monkeypatch):
    monkeypatch.setattr(cpu_memory, "_kept", False)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert cpu_memory.keep_freed_memory() is False
