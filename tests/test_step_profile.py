"""The step profiler (``bench/step_profile.py``) and what it says of the T5 rationale step."""

from __future__ import annotations

import numpy as np
import torch

from fastjudge.bench.step_profile import profile_steps, t5_decode_runner


def test_counts_each_kind_of_host_read():
    """Per-row reads scale with the rows; one batched read is one; ops issued per row show."""
    x = torch.arange(8.0)

    def per_row(rows):
        def run():
            for _ in range(2):  # two steps
                for r in range(rows):
                    int(x[r])
                    x[r:r + 1].tolist()
                    float(x[r].item())
        return run

    def batched():
        for _ in range(2):
            (x * 2).argmax().tolist()

    one, four = profile_steps(per_row(1), steps=2), profile_steps(per_row(4), steps=2)
    assert one.host_syncs == 3 and four.host_syncs == 12
    assert one.reads_by_kind == {"__int__": 2, "tolist": 2, "item": 2}
    assert four.scalar_reads == 8  # int() and .item() go through aten::_local_scalar_dense
    assert four.aten_ops > 3 * one.aten_ops
    b = profile_steps(batched, steps=2)
    assert b.host_syncs == 1 and b.scalar_reads == 0 and b.aten_ops >= 2
    assert b.wall_ms > 0 and b.python_ms >= 0


def test_with_a_gpu_only_reads_of_device_tensors_count():
    """With another device than the CPU, reading a CPU tensor is free and a copy of a device
    tensor to the CPU is the transfer (the meta device stands in for a GPU: no values are read
    from it, only the classification is checked)."""
    from fastjudge.bench.step_profile import _HostReads

    host = torch.ones(3)
    assert profile_steps(lambda: host.tolist(), steps=1, device="meta").host_syncs == 0
    dev = torch.ones(3, device="meta")
    reads = _HostReads(torch.device("meta"))
    assert reads._to_host("cpu", (dev,), {}) and not reads._to_host("cpu", (host,), {})
    assert reads._to_host("to", (dev, "cpu"), {}) and reads._to_host("to", (dev,), {"device": "cpu"})
    assert not reads._to_host("to", (dev, torch.float16), {})
    assert reads._to_host("copy_", (host, dev), {}) and not reads._to_host("copy_", (dev, host), {})


def test_t5_rationale_step_reads_once_whatever_the_rows(t5_backend):
    """``t5_decode.step`` + ``_pick``: one device->host read per step (the chosen ids and
    tracked logits together), no scalar reads, and the same aten ops at 1, 8 and 64 rows."""
    rng = np.random.default_rng(0)
    tracked = torch.tensor([5, 6, 7])  # as LAVE's rationale runs: tracked rating logits
    profiles = {}
    for rows in (1, 8, 64):
        prompts = [rng.integers(10, 200, size=int(rng.integers(8, 40))).astype(np.int64) for _ in range(rows)]
        profiles[rows] = profile_steps(t5_decode_runner(t5_backend.model, prompts, 4, tracked), steps=4)
    for p in profiles.values():
        assert p.host_syncs == 1 and p.reads_by_kind == {"tolist": 4} and p.scalar_reads == 0
    ops = [p.aten_ops for p in profiles.values()]
    assert max(ops) <= 1.1 * min(ops)
