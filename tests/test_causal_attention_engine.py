"""The engine's causal attention over prompts (``fastjudge._engine.causal_attention``,
engine/causal_attention.cpp) against transformers' ``eager_attention_forward``
(transformers/models/qwen3/modeling_qwen3.py: ``repeat_kv``, a causal additive mask, softmax in
float32), in float32 and bfloat16, on the layouts a layer hands it; its thread split (the
process's OpenMP team, or threads of its own without one); the arrays it refuses; and the
dispatch in ``attention.attend_causal`` that uses it. The layer built on it is held against
whole transformers models in tests/test_qwen_faithfulness.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fastjudge import _engine
from fastjudge.backends.cpu_engine import engine_array
from fastjudge.backends.qwen import attention
from fastjudge.backends.qwen.attention import attend_cached, attend_causal, attend_causal_sdpa, attend_in_engine


def eager_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """transformers' attention of ``q`` [B, S, H, hd] over ``k``, ``v`` [B, S, kv_heads, hd]
    under a causal mask, in float32: [B, S, H, hd]."""
    from transformers.models.qwen3.modeling_qwen3 import eager_attention_forward

    S = q.shape[1]
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = q.shape[2] // k.shape[2], False
    mask = torch.full((S, S), float("-inf")).triu_(1)[None, None]
    out, _ = eager_attention_forward(module, *(t.transpose(1, 2).float() for t in (q, k, v)), mask,
                                     scaling=q.shape[-1] ** -0.5)
    return out


def layer_inputs(B, S, H, kv_heads, hd, dtype=torch.float32, seed=0):
    """Queries and keys as views into one fused projection's output, values a view into a
    wider tensor: strided, as a layer hands them over."""
    gen = torch.Generator().manual_seed(seed)
    qk = torch.randn(B, S, H + kv_heads, hd, generator=gen).to(dtype)
    v = torch.randn(B, S, kv_heads, hd + 8, generator=gen).to(dtype)[..., 8:]
    return qk[:, :, :H], qk[:, :, H:], v


def engine_attention(q, k, v, threads=1) -> torch.Tensor:
    B, S, H, hd = q.shape
    out = torch.full((B, S, H, hd), float("nan"), dtype=q.dtype)  # every entry must be written
    _engine.causal_attention(engine_array(q), engine_array(k), engine_array(v), engine_array(out), hd ** -0.5,
                             threads=threads)
    return out


@pytest.mark.parametrize("B,S,H,kv_heads,hd", [
    (1, 1, 1, 1, 8),       # one token: its own value
    (2, 15, 4, 2, 16),     # less than a tile of queries, less than a block of keys
    (3, 16, 2, 2, 64),     # one whole tile
    (2, 33, 4, 1, 80),     # a tile and a bit; a head size that is not a multiple of the key blocks
    (2, 100, 8, 2, 128),
    (1, 257, 4, 4, 32),
])
def test_matches_transformers_in_float32(B, S, H, kv_heads, hd):
    q, k, v = layer_inputs(B, S, H, kv_heads, hd, seed=S)
    assert B * S == 1 or not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    torch.testing.assert_close(engine_attention(q, k, v), eager_reference(q, k, v), rtol=1e-5, atol=1e-5)


def masked_reference(q, keys, values, offsets):
    """transformers' attention of ``q`` [B, S, H, hd] over the pool's ``keys``/``values`` [B,
    kv_heads, W, hd] under the additive mask the model builds for a suffix pass (token ``t`` of
    row ``b`` sees keys up to ``offsets[b] + t``), in float32: [B, S, H, hd]."""
    from transformers.models.qwen3.modeling_qwen3 import eager_attention_forward

    S, W = q.shape[1], keys.shape[2]
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = q.shape[2] // keys.shape[1], False
    hidden = torch.arange(W)[None, None, :] > (offsets[:, None] + torch.arange(S)[None, :])[..., None]
    mask = torch.zeros(len(offsets), 1, S, W).masked_fill_(hidden[:, None], float("-inf"))
    out, _ = eager_attention_forward(module, q.transpose(1, 2).float(), keys.float(), values.float(), mask,
                                     scaling=q.shape[-1] ** -0.5)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S,offsets,H", [
    (1, [0, 5, 200], 4),     # one token a row, two query heads a key head
    (1, [9, 50, 3], 16),     # eight query heads a key head
    (3, [9, 50, 3], 16),     # 24 query rows a key head: two groups of the few-token kernel
    (3, [17, 0, 94], 4),     # a jump-forward run of three tokens
    (5, [0, 3, 40], 4),      # a suffix pass
    (40, [17, 0, 94], 4),
    (70, [100, 30, 1], 4),
])
def test_new_tokens_after_cached_keys(dtype, S, offsets, H, bf16_form):
    """A suffix pass or a decoding step: each row's new tokens after its own number of cached
    keys (its prefix snapshot), read from the pool's [B, kv_heads, capacity, hd] buffers in place;
    a row whose padded tokens would reach past the keys sees them all."""
    gen = torch.Generator().manual_seed(S)
    B, kv_heads, hd = 3, 2, 32
    offsets = torch.tensor(offsets)
    W = int((offsets + S).max()) - 3  # the longest row's last tokens are padding past the keys
    pool = torch.randn(2, B, kv_heads, W + 9, hd, generator=gen).to(dtype)
    keys, values = pool[0, :, :, :W], pool[1, :, :, :W]
    q = torch.randn(B, S, H, hd, generator=gen).to(dtype)
    out = torch.full((B, S, H, hd), float("nan"), dtype=dtype)
    _engine.causal_attention(engine_array(q), engine_array(keys.transpose(1, 2)), engine_array(values.transpose(1, 2)),
                             engine_array(out), hd ** -0.5, offsets.numpy(), threads=2)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), masked_reference(q, keys, values, offsets), rtol=tol, atol=tol)


@pytest.mark.parametrize("offsets", [None, [30, 0, 7]])
def test_padding_tokens_are_skipped(offsets):
    """Tokens past a row's real count are padding: their outputs are zeros (a row with none real
    is all zeros), and the real tokens' outputs are those of the unpadded call."""
    gen = torch.Generator().manual_seed(11)
    B, S, H, kv_heads, hd = 3, 20, 4, 2, 16
    cached = 0 if offsets is None else max(offsets)
    keys, values = torch.randn(2, B, cached + S, kv_heads, hd, generator=gen)
    q = torch.randn(B, S, H, hd, generator=gen)
    starts = None if offsets is None else np.array(offsets)
    full, padded = torch.empty(B, S, H, hd), torch.full((B, S, H, hd), float("nan"))
    counts = np.array([20, 13, 0])
    for out, real in ((full, None), (padded, counts)):
        _engine.causal_attention(q.numpy(), keys.numpy(), values.numpy(), out.numpy(), hd ** -0.5, offsets=starts,
                                 counts=real, threads=2)
    for b, n in enumerate(counts):
        assert torch.equal(padded[b, :n], full[b, :n])
        assert torch.equal(padded[b, n:], torch.zeros_like(padded[b, n:]))


@pytest.mark.parametrize("threads", [1, 2])
def test_short_rows_after_long_ones_read_only_their_own_values(bf16_form, threads):
    """bfloat16 prompts of real counts that shrink row after row (a padded batch): on one thread
    a later row's keys and values lie where an earlier, longer row's were packed, and each row's
    outputs must be the bits of that row attended alone (the tile form multiplies whole tiles of
    keys, with zero weights past a row's own: the values past them must be zero, not stale). The
    first row's later values are NaN: read through a later row's zero weights, they would spoil
    it."""
    B, S, H, kv_heads, hd = 4, 70, 2, 1, 64
    q, k, v = layer_inputs(B, S, H, kv_heads, hd, dtype=torch.bfloat16, seed=5)
    v[0, 40:] = float("nan")
    counts = np.array([70, 40, 33, 5])
    padded = torch.full((B, S, H, hd), float("nan"), dtype=torch.bfloat16)
    _engine.causal_attention(engine_array(q), engine_array(k), engine_array(v), engine_array(padded), hd ** -0.5,
                             counts=counts, threads=threads)
    for b, n in list(enumerate(counts))[1:]:
        alone = engine_attention(q[b:b + 1, :n], k[b:b + 1, :n], v[b:b + 1, :n])
        assert torch.equal(padded[b, :n], alone[0])


@pytest.mark.parametrize("S,hd", [(37, 64), (233, 64), (130, 128)])
def test_bfloat16_against_float32(S, hd, bf16_form):
    """In bfloat16, against the float32 reference: with float32 softmax weights (the portable
    path; the output rounded once) no further from it than SDPA's bfloat16 kernel; with
    bfloat16 dot products (the weights rounded to bfloat16 before the weighted sum, as
    transformers' eager path rounds them) no further than transformers' own bfloat16 path."""
    from transformers.models.qwen3.modeling_qwen3 import eager_attention_forward

    q, k, v = layer_inputs(4, S, 4, 2, hd, dtype=torch.bfloat16, seed=hd)
    want = eager_reference(q, k, v)
    ours = engine_attention(q, k, v)
    assert ours.dtype == torch.bfloat16
    if bf16_form:
        module = torch.nn.Module()
        module.num_key_value_groups, module.training = 2, False
        mask = torch.full((S, S), float("-inf")).triu_(1)[None, None].bfloat16()
        theirs, _ = eager_attention_forward(module, *(t.transpose(1, 2) for t in (q, k, v)), mask, scaling=hd ** -0.5)
    else:
        theirs = torch.nn.functional.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True, enable_gqa=True).transpose(1, 2)
    ours_error = float((ours.float() - want).abs().max())
    assert ours_error <= 1.05 * float((theirs.float() - want).abs().max())
    assert ours_error <= 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_masked_half_is_never_read(dtype, bf16_form):
    """A query's weights cover its own and earlier tokens only: later keys and values poisoned
    with NaN leave earlier tokens' outputs as they were."""
    q, k, v = layer_inputs(2, 40, 4, 2, 16, dtype=dtype, seed=1)
    clean = engine_attention(q, k, v)
    k, v = k.clone(), v.clone()
    k[:, 20:], v[:, 20:] = float("nan"), float("nan")
    poisoned = engine_attention(q, k, v)
    assert torch.equal(poisoned[:, :20], clean[:, :20])
    assert poisoned[:, 20:].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S", [1, 3])
def test_few_new_tokens_never_read_later_keys(dtype, S, bf16_form):
    """A decoding or jump-forward step (the few-token kernel: keys read in place, no packing):
    a token's weights cover its row's keys up to itself; the step's later tokens' keys and values
    and the pool's unused columns, poisoned with NaN, leave its output as it was; padding tokens
    come out as zeros; the same bits on any number of threads."""
    gen = torch.Generator().manual_seed(S)
    B, H, kv_heads, hd, W = 3, 4, 2, 64, 60
    offsets, counts = np.array([10, 0, 40]), np.array([S, S, S - 1])
    pool = torch.randn(2, B, kv_heads, W, hd, generator=gen).to(dtype)
    q = torch.randn(B, S, H, hd, generator=gen).to(dtype)

    def attend(pool, threads=2):
        keys, values = pool[0], pool[1]
        out = torch.full((B, S, H, hd), float("nan"), dtype=dtype)
        _engine.causal_attention(engine_array(q), engine_array(keys.transpose(1, 2)),
                                 engine_array(values.transpose(1, 2)), engine_array(out), hd ** -0.5, offsets,
                                 counts, threads=threads)
        return out

    clean = attend(pool)
    for threads in (1, 3, 8):
        assert torch.equal(attend(pool, threads), clean)
    poisoned = pool.clone()
    for b in range(B):
        poisoned[:, b, :, offsets[b] + 1:] = float("nan")  # past each row's first new token
    first = attend(poisoned)
    assert torch.equal(first[:, 0], clean[:, 0])
    assert not clean.isnan().any()
    assert torch.equal(clean[2, S - 1:], torch.zeros_like(clean[2, S - 1:]))
    want = masked_reference(q, pool[0], pool[1], torch.from_numpy(offsets))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for b, n in enumerate(counts):
        torch.testing.assert_close(clean[b, :n].float(), want[b, :n], rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [2, 3, 4])
# 48 and 80: a block of 32 or 64 columns of the weighted values and a last one of 16 (one or two
# query rows, AVX2 build)
@pytest.mark.parametrize("hd", [16, 48, 64, 80, 128])
def test_few_token_groups_give_each_query_its_own_bits(dtype, group, hd, bf16_form):
    """The few-token kernel scores a key head's group of queries together (each key read once for
    all of them, 16 / group keys a lane-sum): every query's output has the same bits as that
    query attending alone (a group of one), whatever the group and wherever a row's keys end
    in a block; against transformers' eager attention too. Keys and values are read in place,
    bfloat16 ones widened as they load."""
    gen = torch.Generator().manual_seed(group * hd)
    B, kv_heads, W = 3, 2, 130
    offsets = torch.tensor([0, 37, 129])  # 1, 38 and 130 keys a row
    pool = torch.randn(2, B, kv_heads, W + 5, hd, generator=gen).to(dtype)
    keys, values = pool[0, :, :, :W].transpose(1, 2), pool[1, :, :, :W].transpose(1, 2)
    q = torch.randn(B, 1, kv_heads * group, hd, generator=gen).to(dtype)

    def attend(q):
        out = torch.full(q.shape, float("nan"), dtype=dtype)
        _engine.causal_attention(engine_array(q), engine_array(keys), engine_array(values), engine_array(out),
                                 hd ** -0.5, offsets.numpy(), threads=2)
        return out

    grouped = attend(q)
    for r in range(group):
        heads = [hk * group + r for hk in range(kv_heads)]  # one query of each key head's group
        assert torch.equal(attend(q[:, :, heads].contiguous()), grouped[:, :, heads])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    want = masked_reference(q, keys.transpose(1, 2), values.transpose(1, 2), offsets)
    torch.testing.assert_close(grouped.float(), want, rtol=tol, atol=tol)


def two_snapshots(dtype, B, H, kv_heads, hd, S, columns, W, min_count):
    """A problem whose rows belong to two snapshots (rows interleaved), each row holding its own
    copy of its snapshot's first ``columns`` keys and values: (sources, the rows' real token
    counts, ``attend(keys, values, threads, **sharing)`` over the problem's queries and offsets,
    keys, values)."""
    gen = torch.Generator().manual_seed(B * hd + S)
    offsets = columns + torch.randint(0, W - S - columns, (B,), generator=gen)
    counts = torch.randint(min_count, S + 1, (B,), generator=gen)
    counts[0] = S
    snapshot = torch.arange(B) % 2
    sources = torch.tensor([int(torch.nonzero(snapshot == snapshot[b])[0]) for b in range(B)])
    keys, values = (torch.randn(B, W, kv_heads, hd, generator=gen).to(dtype) for _ in range(2))
    for t in (keys, values):
        t[:, :columns] = t[sources, :columns]
    q = torch.randn(B, S, H, hd, generator=gen).to(dtype)

    def attend(k, v, threads, **sharing):
        out = torch.full(q.shape, float("nan"), dtype=dtype)
        _engine.causal_attention(engine_array(q), engine_array(k), engine_array(v), engine_array(out), hd ** -0.5,
                                 offsets.numpy(), counts.numpy(), threads=threads, **sharing)
        return out

    return sources, counts, attend, keys, values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,H,kv_heads,hd,S,columns", [
    (16, 8, 2, 64, 1, 448),  # decoding after a long shared prefix: 8 rows a key head, twice
    (5, 8, 2, 64, 1, 37),    # shared columns ending inside a block
    (7, 4, 2, 128, 2, 130),  # two new tokens a row, some padding
    (9, 2, 1, 32, 1, 64),    # one key head, more rows than a unit
    (4, 8, 2, 64, 2, 64),    # 8 queries of a key head a row: past the lane-sum rows, each row its own
])
def test_shared_columns_read_once_give_each_row_its_own_bits(dtype, B, H, kv_heads, hd, S, columns, bf16_form):
    """Rows of two snapshots whose first ``columns`` keys and values are the same (each row's
    own copy, as the state pool holds them) read them from one row of their snapshot
    (``shared_from``): every output has the bits of each row reading its own. The other rows'
    copies are spoiled with NaN in the shared run, so an output that read them would show it;
    where the problem does not take the shared reading (more than four queries of a key head a
    row), the rows read their own and the copies stay."""
    sources, counts, attend, keys, values = two_snapshots(dtype, B, H, kv_heads, hd, S, columns, columns + 40, 0)
    own = attend(keys, values, 2)
    takes = H // kv_heads * S <= 4
    spoiled = [t.clone() for t in (keys, values)]
    for t in spoiled if takes else ():
        t[sources != torch.arange(B), :columns] = float("nan")
    shared = attend(*spoiled, 2, shared_columns=columns, shared_from=sources.numpy())
    real = torch.arange(S)[None] < counts[:, None]
    assert not own[real].isnan().any() and torch.equal(shared, own)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,H,kv_heads,hd,S,columns", [
    (16, 4, 2, 64, 16, 448),  # a score-only suffix pass after a long shared prefix
    (5, 8, 2, 64, 8, 37),     # shared columns ending inside a register block, an odd count
    (9, 2, 1, 32, 6, 64),     # one key head
    (7, 6, 2, 16, 33, 130),   # more new tokens than a tile
])
@pytest.mark.parametrize("threads", [1, 2])
def test_shared_columns_packed_once_give_each_row_its_own_bits(dtype, B, H, kv_heads, hd, S, columns, threads,
                                                                bf16_form):
    """Suffix passes (more than four new tokens a row) pack each row's keys and values before
    their products; rows of two snapshots (``shared_from``) pack their shared columns once for a
    key head's run of rows of their snapshot: every output has the bits of each row packing its
    own. On one thread the rows after each snapshot's first never have their shared keys read:
    spoiled with NaN there, they change nothing (values are packed in pairs of keys for the
    bfloat16 dot products, so a pair that straddles the shared columns is packed again from the
    row's own copy: those stay)."""
    sources, counts, attend, keys, values = two_snapshots(dtype, B, H, kv_heads, hd, S, columns, columns + S + 30, 1)
    own = attend(keys, values, threads)
    k, v = keys.clone(), values.clone()
    if threads == 1:
        others = sources != torch.arange(B)
        k[others, :columns] = float("nan")
        kept = columns - 1 if dtype == torch.bfloat16 and bf16_form and columns % 2 else columns
        v[others, :kept] = float("nan")
    shared = attend(k, v, threads, shared_columns=columns, shared_from=sources.numpy())
    real = torch.arange(S)[None] < counts[:, None]
    assert not own[real].isnan().any() and torch.equal(shared, own)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_same_bits_on_any_number_of_threads(dtype, bf16_form):
    """Each (row, key head) pair is computed alone, so the split over threads changes nothing."""
    q, k, v = layer_inputs(5, 150, 4, 2, 64, dtype=dtype, seed=7)
    one = engine_attention(q, k, v, threads=1)
    for threads in (2, 3, 8):
        assert torch.equal(engine_attention(q, k, v, threads=threads), one)
    assert _engine.cpu_thread_pool() == "openmp"  # torch's runtime is loaded: the kernels share its team


def test_threads_of_its_own_without_an_openmp_runtime(tmp_path):
    """In a process without torch (no OpenMP runtime loaded) the kernels split their work over
    threads of their own, with the same bits as on one thread."""
    script = tmp_path / "alone.py"
    script.write_text(
        "import sys\n"
        "import numpy as np\n"
        "from fastjudge import _engine\n"
        "assert 'torch' not in sys.modules\n"
        "rng = np.random.default_rng(0)\n"
        "qk = rng.standard_normal((4, 120, 6, 32), dtype=np.float32)\n"
        "q, k = qk[:, :, :4], qk[:, :, 4:]\n"
        "v = np.ascontiguousarray(rng.standard_normal((4, 120, 2, 32), dtype=np.float32))\n"
        "outs = [np.empty((4, 120, 4, 32), np.float32) for _ in range(2)]\n"
        "for out, threads in zip(outs, (1, 2)):\n"
        "    _engine.causal_attention(q, k, v, out, 32 ** -0.5, threads=threads)\n"
        "assert np.array_equal(outs[0], outs[1])\n"
        "print(_engine.cpu_thread_pool())\n")
    package_root = Path(_engine.__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(package_root)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "threads"


def test_refuses_arrays_it_cannot_read_or_write():
    q, k, v = (t.contiguous() for t in layer_inputs(2, 9, 4, 2, 8))
    out = torch.empty(2, 9, 4, 8)
    good = dict(query=q.numpy(), key=k.numpy(), value=v.numpy(), out=out.numpy(), scale=0.5)
    _engine.causal_attention(**good)
    bad = [
        dict(query=q.double().numpy()),                           # float64
        dict(query=q.numpy()[..., 0]),                            # not 4-D
        dict(key=k.numpy()[:, :8]),                               # keys of another length
        dict(key=torch.randn(2, 9, 3, 8).numpy(), value=torch.randn(2, 9, 3, 8).numpy()),  # 4 heads on 3
        dict(value=v.numpy()[..., :4]),                           # values of another size
        dict(key=k.transpose(2, 3).contiguous().transpose(2, 3).numpy()),  # rows not contiguous
        dict(key=k.to(torch.bfloat16).view(torch.int16).numpy()),  # dtypes mixed
        dict(out=torch.empty(2, 9, 4, 8, dtype=torch.float64).numpy()),
        dict(out=torch.empty(2, 4, 9, 8).transpose(1, 2).numpy()),  # out not C-contiguous
        dict(scale=0.0),
        dict(offsets=np.array([0])),                               # not one per row
        dict(offsets=np.array([0, -1])),                           # negative
        dict(offsets=np.array([0.0, 1.0])),                        # not integers
        dict(counts=np.array([9, 10])),                            # more than S
        dict(counts=np.array([9])),                                # not one per row
        dict(key=torch.randn(2, 12, 2, 8).numpy(), value=torch.randn(2, 12, 2, 8).numpy()),  # W != S, no offsets
        dict(query=[[[[1.0]]]]),                                  # not an array
        dict(shared_columns=4, shared_from=np.array([0, 0])),      # sharing without offsets
        dict(offsets=np.array([0, 0]), shared_columns=4, shared_from=np.array([0, 2])),  # not a row
        dict(offsets=np.array([0, 0]), shared_columns=4, shared_from=np.array([0])),  # not one per row
    ]
    for change in bad:
        with pytest.raises(ValueError):
            _engine.causal_attention(**{**good, **change})
    frozen = out.numpy().copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError):
        _engine.causal_attention(**{**good, "out": frozen})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatch_takes_the_engine_on_the_cpu(dtype, monkeypatch):
    """``attend_causal`` hands float32 and bfloat16 CPU prompts to the engine (the same values
    as calling it directly) and returns the [B, H, S, hd] view the layer transposes back;
    float16 keeps SDPA."""
    q, k, v = layer_inputs(2, 70, 4, 2, 16, dtype=dtype, seed=3)
    got = attend_causal(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), gqa=True)
    assert got.shape == (2, 4, 70, 16) and got.transpose(1, 2).is_contiguous()
    assert torch.equal(got.transpose(1, 2), engine_attention(q, k, v, threads=torch.get_num_threads()))
    # a suffix pass (more than FOLD_QUERY_STEPS new tokens, offsets given) takes it too, under
    # the mask's rule; without offsets (a compiled step's) SDPA under the mask
    keys, values = k.transpose(1, 2), v.transpose(1, 2)
    offsets = torch.zeros(2, dtype=torch.long)
    mask = torch.full((70, 70), float("-inf")).triu_(1).expand(2, 1, 70, 70).to(dtype)
    assert torch.equal(attend_cached(q, keys, values, mask, offsets=offsets), got)
    sdpa = attend_cached(q, keys, values, mask)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(sdpa, got, rtol=tol, atol=tol)
    # a decoding step (at most FOLD_QUERY_STEPS new tokens, offsets given) of enough rows: the
    # few-token kernel; of fewer rows, SDPA with the query heads folded
    few = attend_cached(q[:, :3], keys, values, mask[:, :, :3], offsets=offsets)
    assert not torch.equal(few, attend_in_engine(q[:, :3], keys, values, offsets))
    torch.testing.assert_close(few, got[:, :, :3], rtol=tol, atol=tol)
    monkeypatch.setattr(attention, "ENGINE_FEW_TOKENS_MIN_ROWS", 2)
    few = attend_cached(q[:, :3], keys, values, mask[:, :, :3], offsets=offsets)
    assert torch.equal(few, attend_in_engine(q[:, :3], keys, values, offsets))
    torch.testing.assert_close(few, got[:, :, :3], rtol=tol, atol=tol)

    def refuse(*args, **kwargs):
        raise AssertionError("the engine was called")

    monkeypatch.setattr(_engine, "causal_attention", refuse)
    half = [t.transpose(1, 2).half() for t in (q, k, v)]
    torch.testing.assert_close(attend_causal(*half, gqa=True), attend_causal_sdpa(*half, gqa=True))
