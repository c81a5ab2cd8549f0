"""Greedy decoding of a batch of Qwen rows that share one prefix state, optionally constrained by
a grammar (Json specs): all rows decode together, one token per row per step, each attending to
its own length only, until every row has met EOS or its token limit."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..runtime.requests import Output, Request
from .qwen_model import PrefixState, QwenModel, QwenShape

DECODE_ROOM = 256  # K/V room allocated for new tokens up front; longer outputs double the buffers


class DecodeCache:
    """Per-row decoding state of a batch: K/V buffers of the full-attention layers (rows of
    different lengths right-padded; a row attends to its own length only) that grow by doubling,
    and the DeltaNet conv/recurrent states stacked over rows."""

    def __init__(self, states: Sequence[PrefixState], shape: QwenShape, room: int, device):
        first = states[0].layers
        self.lengths = torch.tensor([st.length for st in states], device=device)
        self.positions = torch.tensor([st.next_position for st in states], device=device)
        longest = int(self.lengths.max())
        self.layers: list = []
        for i, kind in enumerate(shape.layer_types):
            if kind == "full_attention":
                k0 = first[i][0]
                bufs = [k0.new_zeros(len(states), k0.shape[1], longest + room, k0.shape[3]) for _ in range(2)]
                for b, st in enumerate(states):
                    for buf, t in zip(bufs, st.layers[i]):
                        buf[b, :, : t.shape[2]] = t[0]
                self.layers.append(bufs)
            else:
                self.layers.append(tuple(torch.cat([st.layers[i][j] for st in states]) for j in range(2)))
        self.kinds = shape.layer_types

    @property
    def capacity(self) -> int:
        """Length of the K/V buffers (0 without full-attention layers)."""
        return next((pair[0].shape[2] for kind, pair in zip(self.kinds, self.layers) if kind == "full_attention"), 0)

    def reserve(self, steps: int) -> None:
        """Room for ``steps`` more tokens in every K/V buffer (doubling when short)."""
        need = int(self.lengths.max()) + steps
        for i, kind in enumerate(self.kinds):
            if kind != "full_attention" or self.layers[i][0].shape[2] >= need:
                continue
            self.layers[i] = [torch.cat([b, torch.zeros_like(b)[:, :, : max(need - b.shape[2], b.shape[2])]], dim=2)
                              for b in self.layers[i]]


def decode_greedy(model: QwenModel, hidden: torch.Tensor, cache: DecodeCache, batch: Sequence[Request],
                  matchers: Sequence, eos_token_ids: set[int], pad_token_id: int) -> tuple[list[Output], int]:
    """Greedy decoding of ``batch`` (one Text/Json spec) from ``hidden`` [B, d], the final states
    of each row's prompt, and ``cache``, the rows' model state there. ``matchers``: per row, a
    grammar matcher (Json) or None (Text). Returns the outputs and the number of tokens run
    through the model (finished rows are padded, not counted)."""
    spec = batch[0].spec
    device = hidden.device
    track = torch.tensor(spec.track_ids, device=device) if getattr(spec, "track_ids", ()) else None
    tokens = [[] for _ in batch]
    tracked = [[] for _ in batch]
    finished = [False] * len(batch)
    done = [False] * len(batch)
    computed = 0
    for _ in range(spec.max_new_tokens):
        logits = model.logits(hidden)
        step = []
        for b, matcher in enumerate(matchers):
            if done[b]:
                step.append(pad_token_id)
                continue
            z = logits[b] if matcher is None else matcher.mask(logits[b])
            token = int(z.argmax())
            if matcher is not None:
                matcher.accept(token)
            if token in eos_token_ids:
                finished[b] = done[b] = True
            else:
                tokens[b].append(token)
                if track is not None:
                    tracked[b].append(logits[b, track])
                done[b] = len(tokens[b]) == spec.max_new_tokens
            step.append(token)
        if all(done):
            break
        computed += sum(not d for d in done)
        hidden = model.decode_step(torch.tensor(step, device=device), cache)
    outputs = []
    for b, r in enumerate(batch):
        out = Output(index=r.index, token_ids=tokens[b],
                     finished=matchers[b].finished if matchers[b] is not None else finished[b])
        if track is not None:
            out.tracked_logits = (torch.stack(tracked[b]).cpu().numpy().astype(np.float64) if tracked[b]
                                  else np.zeros((0, len(spec.track_ids))))
        outputs.append(out)
    return outputs, computed
