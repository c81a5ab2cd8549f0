"""The next-token bitmask of a decoding batch: one ``[rows, ceil(V/32)]`` int32 bitmask on the
host, each row filled by its row's grammar matcher (``runtime.grammar.JsonMatcher``), applied
to the batch's logits in one call per step."""

from __future__ import annotations

import numpy as np
import torch


def bit_set(words: np.ndarray, token: int) -> bool:
    """Whether bitmask row ``words`` allows ``token``."""
    return bool((int(words[token // 32]) >> (token % 32)) & 1)


def forced_in(words: np.ndarray, vocab_size: int) -> int | None:
    """The one token a bitmask row ``words`` (int32 ``[ceil(V/32)]``) allows, or None where it
    allows several or none. Host-side numpy only: no tensor op."""
    nonzero = np.flatnonzero(words)
    if len(nonzero) != 1:
        return None
    w = int(nonzero[0])
    bits = int(words[w]) & 0xFFFFFFFF
    if bits & (bits - 1):
        return None
    token = w * 32 + bits.bit_length() - 1
    return token if token < vocab_size else None


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int,
                  backend: str = "torch_native") -> None:
    """Every token a CPU bitmask ``[rows, ceil(V/32)]`` disallows set to ``-inf`` in float32
    ``logits`` ``[rows, V]``, in place: xgrammar's CPU kernel for CPU logits; else one copy of
    the bitmask to the logits' device and ``backend`` there."""
    import xgrammar as xgr

    if logits.device.type == "cpu":
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, backend="cpu")
    else:
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                        vocab_size=vocab_size, backend=backend)


class TokenMask:
    """One next-token bitmask for a decoding batch: ``[rows, ceil(V/32)]`` int32 on the host
    (pinned for an asynchronous copy where the logits live on CUDA), each row filled by its
    row's matcher, applied to the batch's logits in one call per step (as vLLM and SGLang do)."""

    def __init__(self, rows: int, vocab_size: int, device, backend: str = "torch_native"):
        import xgrammar as xgr

        self.vocab_size = int(vocab_size)
        self.backend = backend
        bitmask = xgr.allocate_token_bitmask(rows, vocab_size)
        pin = torch.device(device).type == "cuda"
        self.bitmask = bitmask.pin_memory() if pin else bitmask
        self.words = self.bitmask.numpy()  # one view: host reads of a row issue no tensor op

    def fill(self, row: int, matcher) -> np.ndarray:
        """Row ``row`` from ``matcher`` (returned as a numpy view)."""
        return matcher.fill_row(self.bitmask, row, self.words)

    def forced(self, row: int) -> int | None:
        """The one token row ``row`` allows, or None (see :func:`forced_in`)."""
        return forced_in(self.words[row], self.vocab_size)

    def apply(self, logits: torch.Tensor) -> None:
        """The first ``len(logits)`` rows applied to ``logits`` ``[rows, V]`` (float32), in place."""
        apply_bitmask(logits, self.bitmask[: logits.shape[0]], self.vocab_size, self.backend)
