"""``backends/cpu_memory.py``: glibc's malloc thresholds set once, and left alone where the
environment already tunes malloc; the engine's panels in huge pages where the kernel grants them."""

from __future__ import annotations

import mmap
import platform
from pathlib import Path

import numpy as np
import pytest
import torch

from fastjudge.backends import cpu_memory
from fastjudge.backends.dense import pack_panels

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


def _huge_pages_offered() -> bool:
    # the kernel grants transparent huge pages to a region advised for them ("always" or "madvise")
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return hasattr(mmap, "MADV_HUGEPAGE") and setting.exists() and "[never]" not in setting.read_text()


def _huge_kib(address: int) -> int:
    """AnonHugePages of the mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, stop = (int(x, 16) for x in head.split("-"))
            inside = start <= address < stop
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


def _fallbacks() -> int:
    # faults in advised regions that got ordinary pages for want of a huge one (/proc/vmstat)
    for line in Path("/proc/vmstat").read_text().splitlines():
        if line.startswith("thp_fault_fallback "):
            return int(line.split()[1])
    return 0


def test_huge_page_arrays_are_aligned_and_small_ones_plain():
    big = cpu_memory.huge_page_empty((3, 1024, 1024), np.float32)  # 12 MiB
    assert big.shape == (3, 1024, 1024) and big.dtype == np.float32 and big.flags.c_contiguous
    assert big.flags.writeable
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert big.ctypes.data % cpu_memory.HUGE_PAGE_BYTES == 0
    big[...] = 1.5
    assert float(big.sum()) == 1.5 * big.size
    small = cpu_memory.huge_page_empty((100, 64), np.int32)
    assert small.shape == (100, 64) and small.dtype == np.int32 and small.base is None  # np.empty's own


@pytest.mark.skipif(not _huge_pages_offered(), reason="the kernel offers no transparent huge pages")
def test_the_kernel_backs_large_panels_with_huge_pages():
    """A float32 weight of 8 MiB packed into panels lies in huge pages once written (what
    ``MADV_HUGEPAGE`` asks for; the values are the weight's)."""
    weight = torch.randn(2048, 1024)
    fallbacks = _fallbacks()
    panels = pack_panels(weight)
    # granted, or refused for want of a free 2 MiB block (which the kernel counts)
    assert _huge_kib(panels.ctypes.data) >= cpu_memory.HUGE_PAGE_BYTES // 1024 or _fallbacks() > fallbacks
    assert torch.equal(torch.from_numpy(panels).transpose(1, 2).reshape(2048, 1024), weight)
