"""How far the FP8 judge is from the judge it was built from, on held-out items.

Figures, over the held-out items both judges score:

* ``rating_agreement``: the fraction of items with the same rating (argmax over 1/2/3);
* ``spearman_soft_score``: Spearman correlation of the soft scores (expected score under the
  rating probabilities); null when either side is constant;
* ``max_abs_dprob`` / ``mean_abs_dprob``: the largest and mean absolute difference of any rating
  probability.

Two comparisons, both through ``LaveJudge`` (same prompts, same rating tokens):

1. ``fp8``: transformers' model in the reference dtype against the same model with ModelOpt's
   FP8 fake quantization (weights, activations and, where kept in FP8, K/V rounded to E4M3 with
   the calibrated scales): what the FP8 engine computes, on the CPU or a GPU. The build's
   threshold applies here.
2. ``fp8_checkpoint_torch``: fastjudge's torch backend on the source checkpoint against the same
   backend on the written FP8 checkpoint (weights dequantized, activations not quantized): the
   FP8 judge as usable without TensorRT-LLM.

Below the threshold (98% rating agreement by default) the builder warns loudly.
"""

from __future__ import annotations

import logging
import math
import sys
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np
import torch

from fastjudge.runtime.requests import Choice, Output, choice_probs

from . import DEFAULT_MIN_AGREEMENT

log = logging.getLogger("fastjudge")

DEFAULT_THRESHOLD = DEFAULT_MIN_AGREEMENT


@dataclass
class Agreement:
    items: int
    rating_agreement: float | None
    spearman_soft_score: float | None
    max_abs_dprob: float | None
    mean_abs_dprob: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def compare(reference: Sequence, candidate: Sequence) -> Agreement:
    """Agreement of two result lists (``LaveResult``-like: ``index``, ``rating``, ``probs``,
    ``soft_score``), over the items both scored."""
    from fastjudge.metrics.stats import spearman

    cand = {r.index: r for r in candidate if r.probs is not None and r.error is None}
    pairs = [(r, cand[r.index]) for r in reference if r.probs is not None and r.error is None and r.index in cand]
    if not pairs:
        return Agreement(0, None, None, None, None)
    same = np.mean([a.rating == b.rating for a, b in pairs])
    dp = np.abs(np.array([a.probs for a, _ in pairs]) - np.array([b.probs for _, b in pairs]))
    rho = spearman([a.soft_score for a, _ in pairs], [b.soft_score for _, b in pairs]) if len(pairs) > 1 else math.nan
    return Agreement(items=len(pairs), rating_agreement=float(same),
                     spearman_soft_score=None if math.isnan(rho) else float(rho),
                     max_abs_dprob=float(dp.max()), mean_abs_dprob=float(dp.mean()))


def below_threshold_message(agreement: Agreement, threshold: float, what: str) -> str | None:
    """The loud warning text when ``agreement`` is under ``threshold`` (None when it is not)."""
    if agreement.rating_agreement is None:
        return f"{what}: no held-out item was scored by both judges; agreement unknown"
    if agreement.rating_agreement >= threshold:
        return None
    return (f"{what}: rating agreement {agreement.rating_agreement:.1%} over {agreement.items} held-out "
            f"items is below {threshold:.0%}. This FP8 judge does not reproduce the reference judge's "
            "ratings; do not report its scores as the reference metric's.")


def shout(message: str) -> None:
    """A warning nobody scrolling a build log can miss."""
    bar = "!" * 78
    print(f"\n{bar}\nWARNING: {message}\n{bar}\n", file=sys.stderr, flush=True)
    log.warning(message)


class TransformersChoiceBackend:
    """A fastjudge backend whose ``Choice`` steps run a transformers model (e.g. one carrying
    ModelOpt fake quantizers); tokenization and limits come from ``base``, a fastjudge backend of
    the same checkpoint, so prompts and candidate tokens are identical. Rows run in right-padded
    batches with an attention mask and are read at their own last token."""

    def __init__(self, model, base, encoder_decoder: bool):
        self.model = model
        self.base = base
        self.encoder_decoder = encoder_decoder
        self.kind = base.kind
        self.max_input_tokens = base.max_input_tokens
        self.default_batch_tokens = base.default_batch_tokens
        self.device = next(model.parameters()).device
        self.codec = base.codec
        self.pad_id = base.codec.pad_token_id
        self.start_id = getattr(getattr(model, "config", None), "decoder_start_token_id", 0) or 0

    def cost(self, request) -> int:
        return request.num_tokens  # whole prompts run: no prefix state is kept

    def group_key(self, request) -> None:
        return None

    @torch.inference_mode()
    def run(self, batch) -> list[Output]:
        if any(not isinstance(r.spec, Choice) for r in batch):
            raise NotImplementedError("the agreement check runs score-only (Choice) requests")
        rows = [np.asarray(r.prompt_ids, dtype=np.int64) for r in batch]
        if self.encoder_decoder:
            logits = self._t5(rows, [list(r.response_prefix) for r in batch])
        else:
            logits = self._causal([np.concatenate([x, np.asarray(r.response_prefix, dtype=np.int64)])
                                   for x, r in zip(rows, batch)])
        outputs = []
        for r, z in zip(batch, logits):
            z = z[list(r.spec.token_ids)].double().cpu().numpy()
            outputs.append(Output(index=r.index, logits=z, probs=choice_probs(z)))
        return outputs

    def _padded(self, rows: Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(x) for x in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, x in enumerate(rows):
            ids[i, : len(x)] = torch.from_numpy(x)
            mask[i, : len(x)] = 1
        return ids.to(self.device), mask.to(self.device)

    def _t5(self, rows, prefixes) -> list[torch.Tensor]:
        ids, mask = self._padded(rows)
        dec, dec_mask = self._padded([np.asarray([self.start_id, *p], dtype=np.int64) for p in prefixes])
        out = self.model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec,
                         decoder_attention_mask=dec_mask).logits
        return [out[i, len(p)].float() for i, p in enumerate(prefixes)]

    def _causal(self, rows) -> list[torch.Tensor]:
        ids, mask = self._padded(rows)
        out = self.model(input_ids=ids, attention_mask=mask).logits
        return [out[i, len(x) - 1].float() for i, x in enumerate(rows)]


def score(judge, examples) -> list:
    """The judge's results in input order."""
    return sorted(judge.stream(examples), key=lambda r: r.index)


def agreement_entry(reference: Sequence, candidate: Sequence, threshold: float | None, what: str,
                    details: dict) -> dict:
    """One comparison of the report: its figures, what was compared, and the warning if any."""
    agreement = compare(reference, candidate)
    entry = {**agreement.to_dict(), **details}
    if threshold is not None:
        entry["threshold"] = threshold
        entry["passed"] = agreement.rating_agreement is not None and agreement.rating_agreement >= threshold
        message = below_threshold_message(agreement, threshold, what)
        entry["warning"] = message
        if message:
            shout(message)
    return entry


def format_report(report: dict) -> str:
    """A short human-readable block of the agreement figures."""
    lines = []
    for name, e in report.items():
        if not isinstance(e, dict) or "items" not in e:
            continue
        ra = "n/a" if e["rating_agreement"] is None else f"{e['rating_agreement']:.1%}"
        rho = "n/a" if e["spearman_soft_score"] is None else f"{e['spearman_soft_score']:.4f}"
        dp = "n/a" if e["max_abs_dprob"] is None else f"{e['max_abs_dprob']:.4f}"
        lines.append(f"  {name}: {e['items']} items, rating agreement {ra}, Spearman {rho}, max |dp| {dp}")
    return "\n".join(lines)
