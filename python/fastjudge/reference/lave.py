"""LAVE with transformers on the judge's own prompts.

* :class:`TransformersLave` -- score-only and rationale modes, what a transformers user writes:
  the prompt text of ``LaveJudge.build_prompt`` (decoder-only checkpoints: through the chat
  template, thinking off), padded batches (decoder-only: left-padded). Score-only: one forward
  step, softmax over the three rating tokens' logits. Rationale: greedy ``generate`` up to the
  judge's ``max_new_tokens``, stopping at the checkpoint's EOS tokens; the rating rule as the
  judge states it -- the last character of the decoded text when it is 1, 2 or 3 (probabilities
  from the step that wrote it when that token is a rating token after the cue), else the rating
  cue appended and one step restricted to the ratings (``on_unparsable="constrain"``) or
  rating 2 (``"official"``).
* :class:`AuthorsLave` -- the LAVE authors' scoring (``lave_ft5.py`` of their repository:
  ``LaveFT5.batch_compute``, ``generate`` and ``postprocess``) on the prompts of their own
  builder (``LaveJudge(official_repo=...)`` runs it): ``generate`` with ``max_new_tokens``
  (100, theirs), greedy (Flan-T5's own setting); in each returned row
  (decoder start token first) the token just before the first EOS (no EOS: the last column),
  decoded on its own; rating 2 unless that text is exactly "1", "2" or "3"; score (r - 1) / 2.
"""

from __future__ import annotations

import numpy as np
import torch

from ..judges.lave import RATINGS, LaveResult
from ..runtime.requests import choice_probs
from .models import chat_text, left_padded, load_model

SOFT_WEIGHTS = (0.0, 0.5, 1.0)


class _LaveReference:
    def __init__(self, model_dir, judge, device="cpu", dtype="float32", batch_size: int = 8):
        self.model, self.tok = load_model(model_dir, dtype, device)
        self.judge = judge
        self.device = torch.device(device)
        self.batch_size = max(1, int(batch_size))
        self.encoder_decoder = bool(self.model.config.is_encoder_decoder)
        self.eos = sorted(judge.codec.eos_token_ids)
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos[0]
        self.generated_lengths: list[int] = []  # tokens each generation wrote (EOS excluded), last score call

    # -- inputs --------------------------------------------------------------------------------
    def prompt_ids(self, example) -> list[int]:
        """The token ids transformers gets for ``example``'s prompt; ValueError for an item the
        judge refuses (invalid, or longer than its model limit)."""
        prompt = self.judge.build_prompt(example)
        if self.encoder_decoder:
            ids = self.tok(prompt).input_ids  # with EOS, as T5 is trained
        else:
            ids = self.tok(chat_text(self.tok, prompt), add_special_tokens=False).input_ids
        limit = self.judge.backend.max_input_tokens
        if len(ids) > limit:
            raise ValueError(f"prompt is {len(ids)} tokens, above the model limit of {limit}")
        return ids

    def _batch(self, rows: list[list[int]]) -> dict:
        if self.encoder_decoder:
            width = max(map(len, rows))
            ids = torch.tensor([list(r) + [self.pad] * (width - len(r)) for r in rows])
            mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        else:
            ids, mask = left_padded(rows, self.pad)
        return dict(input_ids=ids.to(self.device), attention_mask=mask.to(self.device))

    def _start(self, rows: int, *continuation) -> torch.Tensor:
        start = self.model.config.decoder_start_token_id
        return torch.tensor([[start, *c] for c in continuation] if continuation else [[start]] * rows,
                            device=self.device)

    @torch.inference_mode()
    def _next_token_logits(self, ids: list[int], response: list[int], candidates) -> np.ndarray:
        """Logits of ``candidates`` after the prompt ``ids`` and the response tokens so far."""
        if self.encoder_decoder:
            out = self.model(input_ids=torch.tensor([ids], device=self.device),
                             decoder_input_ids=self._start(1, list(response)))
        else:
            out = self.model(input_ids=torch.tensor([ids + list(response)], device=self.device))
        return out.logits[0, -1, list(candidates)].double().cpu().numpy()

    @torch.inference_mode()
    def _generate(self, rows: list[list[int]], **settings):
        """Greedy generation: (each row's new tokens up to its first EOS, whether it stopped at
        EOS, the per-step logits [rows, steps, vocab])."""
        batch = self._batch(rows)
        out = self.model.generate(**batch, max_new_tokens=self.judge.max_new_tokens,
                                  return_dict_in_generate=True, output_logits=True,
                                  pad_token_id=self.pad, **settings)
        skip = 1 if self.encoder_decoder else batch["input_ids"].shape[1]
        new = out.sequences[:, skip:].tolist()
        logits = torch.stack(out.logits, dim=1)
        tokens, stopped = [], []
        for row in new:
            stop = next((i for i, t in enumerate(row) if t in self.eos), None)
            tokens.append(row if stop is None else row[:stop])
            stopped.append(stop is not None)
        self.generated_lengths += [len(t) for t in tokens]
        return tokens, stopped, logits, out.sequences

    # -- running -------------------------------------------------------------------------------
    def score(self, examples, progress=None) -> list[LaveResult]:
        results = [LaveResult(index=i, id=getattr(ex, "id", None)) for i, ex in enumerate(examples)]
        self.generated_lengths = []
        todo = []
        for res, ex in zip(results, examples):
            try:
                ids = self.prompt_ids(ex)
            except (ValueError, TypeError, AttributeError) as bad:
                res.error = f"invalid example: {bad}"
                continue
            res.prompt_tokens = len(ids)
            todo.append((res, ids))
        if progress:
            progress(len(results) - len(todo))
        for i in range(0, len(todo), self.batch_size):
            chunk = todo[i: i + self.batch_size]
            self._score_batch([r for r, _ in chunk], [ids for _, ids in chunk])
            if progress:
                progress(len(chunk))
        return results

    @staticmethod
    def _set(result: LaveResult, rating: int, probs, source: str, soft_when_none: bool = True) -> None:
        result.rating, result.score, result.rating_source = rating, (rating - 1) / 2, source
        if probs is not None:
            result.probs = [float(p) for p in probs]
            result.soft_score = float(np.dot(probs, SOFT_WEIGHTS))
        elif soft_when_none:
            result.soft_score = result.score


class TransformersLave(_LaveReference):
    """Score-only and rationale LAVE (module docstring)."""

    @torch.inference_mode()
    def _score_batch(self, results, rows) -> None:
        if not self.judge.rationale:
            rating_ids = list(self.judge.rating_token_ids)
            batch = self._batch(rows)
            if self.encoder_decoder:
                logits = self.model(**batch, decoder_input_ids=self._start(len(rows))).logits[:, -1]
            else:
                logits = self.model(**batch, logits_to_keep=1).logits[:, -1]
            probs = torch.softmax(logits[:, rating_ids].double(), -1).cpu().numpy()
            for res, p in zip(results, probs):
                self._set(res, RATINGS[int(np.argmax(p))], p, "choice")
            return
        judge = self.judge
        cue_ratings = list(judge._cue_rating_ids)
        tokens, _, logits, _ = self._generate(rows, do_sample=False, num_beams=1, eos_token_id=self.eos)
        for r, (res, ids, toks) in enumerate(zip(results, rows, tokens)):
            text = self.tok.decode(toks, skip_special_tokens=True)
            res.rationale = text
            last = text.rstrip()[-1:]
            if last in ("1", "2", "3"):
                probs = None
                if toks and toks[-1] in cue_ratings:
                    probs = choice_probs(logits[r, len(toks) - 1, cue_ratings].double().cpu().numpy())
                self._set(res, int(last), probs, "parsed")
            elif judge.on_unparsable == "official":
                self._set(res, 2, None, "official-fallback")
            else:  # the cue appended, one step restricted to the ratings
                z = self._next_token_logits(ids, list(toks) + list(judge.style.cue_ids), cue_ratings)
                probs = choice_probs(z)
                self._set(res, RATINGS[int(np.argmax(probs))], probs, "constrained")


class AuthorsLave(_LaveReference):
    """The authors' ``batch_compute`` path on their builder's prompts (module docstring)."""

    @torch.inference_mode()
    def _score_batch(self, results, rows) -> None:
        # their generate call (the checkpoint's own settings, max_new_tokens), held to greedy
        # decoding at the judge's stop tokens: a checkpoint that asks for sampling would make
        # any two runs differ
        tokens, _, logits, _ = self._generate(rows, do_sample=False, num_beams=1, eos_token_id=self.eos)
        families = self.judge.style.rating_families
        for r, (res, toks) in enumerate(zip(results, tokens)):
            if self.judge.rationale:
                res.rationale = self.tok.decode(toks, skip_special_tokens=True)
            # the token before the first EOS; EOS first: the decoder start token, never a digit
            token = toks[-1] if toks else None
            text = None if token is None else self.tok.decode([token], clean_up_tokenization_spaces=True)
            if text not in ("1", "2", "3"):
                self._set(res, 2, None, "official-fallback", soft_when_none=False)
                continue
            family = next((f for f in families if token in f), None)
            probs = None if family is None else choice_probs(
                logits[r, len(toks) - 1, list(family)].double().cpu().numpy())
            self._set(res, int(text), probs, "parsed", soft_when_none=False)
