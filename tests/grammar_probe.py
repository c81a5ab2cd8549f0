"""A test's view of one grammar matcher, read through the engine's own path: the matcher's
``fill_row`` into a one-row batch bitmask, applied by ``token_mask.apply_bitmask`` and read by
``token_mask.forced_in`` (what ``TokenMask`` does for each row of a decoding batch)."""

from __future__ import annotations

import torch

from fastjudge.runtime.token_mask import apply_bitmask, forced_in


def _row(matcher) -> tuple[torch.Tensor, object]:
    bitmask = torch.zeros(1, (matcher.vocab_size + 31) // 32, dtype=torch.int32)
    return bitmask, matcher.fill_row(bitmask, 0)


def allowed(matcher) -> torch.Tensor:
    """Boolean ``[V]`` of the tokens the matcher allows next (none once it has terminated)."""
    if matcher.finished:
        return torch.zeros(matcher.vocab_size, dtype=torch.bool)
    bitmask, _ = _row(matcher)
    bits = (bitmask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(-1)[: matcher.vocab_size].bool()


def masked(matcher, logits: torch.Tensor) -> torch.Tensor:
    """``logits`` ``[V]`` or ``[1, V]`` as a new float32 tensor, every disallowed token -inf."""
    if logits.numel() != matcher.vocab_size:
        raise ValueError(f"expected {matcher.vocab_size} logits, got {tuple(logits.shape)}")
    out = logits.detach().to(torch.float32, copy=True).contiguous()
    bitmask, _ = _row(matcher)
    apply_bitmask(out.view(1, -1), bitmask, matcher.vocab_size)
    return out


def forced(matcher) -> int | None:
    """The one token the matcher allows next, or None (several, none, or terminated)."""
    return None if matcher.finished else forced_in(_row(matcher)[1], matcher.vocab_size)
