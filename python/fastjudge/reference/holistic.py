"""The holistic judge's reference: VQAScore as t2v_metrics computes it for Qwen3-VL / Qwen3.5
(``t2v_metrics/models/vqascore_models/qwen3vl_model.py``, ``Qwen3VLModel.forward``), one
image-text pair at a time:

* the image through transformers' image processor (``Qwen2VLImageProcessorPil`` built from the
  checkpoint's preprocessor_config.json; the image decoded as fastjudge decodes it, then handed
  over as a PIL image);
* the user turn [image, question] through the chat template with thinking off, the image pad
  expanded to the image's token count;
* ``generate`` at batch size 1, ``max_new_tokens=1``, greedy, ``output_scores=True``; the
  generated token decoded as t2v_metrics does;
* the score: the softmax over the full vocabulary of that step's scores at the first token of
  ``"Yes"`` (``tokenizer.encode("Yes")[0]``).

The question is the judge's own template (``template="vqascore"``: VQAScore's question; or
fastjudge's instruction and question), and ``normalize="yes-no"`` renormalises over the two
answer tokens instead of the vocabulary.
"""

from __future__ import annotations

import torch

from ..io.images import ImageError, read_image
from ..judges.holistic import HolisticResult
from .models import PLACEHOLDER, chat_text, expand_image_pads, image_processor, load_model


class VQAScoreReference:
    def __init__(self, model_dir, judge, device="cpu", dtype="float32"):
        self.model, self.tok = load_model(model_dir, dtype, device)
        self.processor, self.merge = image_processor(model_dir)
        self.judge = judge
        self.device = torch.device(device)
        self.image_token_id = self.model.config.image_token_id
        if judge.template == "vqascore":  # the first token of each word, as t2v_metrics reads "Yes"
            self.yes_no = tuple(self.tok.encode(w, add_special_tokens=False)[0] for w in ("Yes", "No"))
        else:
            self.yes_no = tuple(judge.yes_no_ids)

    def user_turn(self, text: str) -> str:
        """The judge's prompt for ``text`` with the image slot written as Qwen's placeholder."""
        prefix, rest = self.judge._prompt(PLACEHOLDER, text)
        return "".join(prefix) + rest

    def inputs(self, image, text: str):
        """(input ids, pixel values, grid) of one pair, as the processor call gives them."""
        enc = self.processor(images=[image], return_tensors="pt")
        prompt = expand_image_pads([chat_text(self.tok, self.user_turn(text))], enc["image_grid_thw"], self.merge)[0]
        ids = self.tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        return ids.to(self.device), enc["pixel_values"].to(self.device), enc["image_grid_thw"].to(self.device)

    @torch.inference_mode()
    def probs(self, ids, pixel_values, grid) -> list[float]:
        """[P(yes), P(no)] of one pair: one greedy generate step's scores."""
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixel_values,
                                  image_grid_thw=grid, mm_token_type_ids=(ids == self.image_token_id).int(),
                                  max_new_tokens=1, do_sample=False, output_scores=True,
                                  return_dict_in_generate=True)
        self.tok.decode(out.sequences[0][ids.shape[1]:], skip_special_tokens=True)  # as t2v_metrics does
        scores = out.scores[-1][0].double()
        if self.judge.normalize == "vocab":
            p = torch.softmax(scores, -1)[list(self.yes_no)]
        else:
            p = torch.softmax(scores[list(self.yes_no)], -1)
        return [float(v) for v in p]

    def score(self, examples, progress=None) -> list[HolisticResult]:
        from PIL import Image

        results = []
        for i, ex in enumerate(examples):
            res = HolisticResult(index=i, id=getattr(ex, "id", None))
            try:
                if not isinstance(ex.text, str) or not ex.text.strip():
                    raise ValueError("text (the caption) must be a non-empty string")
                array, _ = read_image(ex.image, self.judge.image_root, self.judge.max_image_pixels)
                ids, pixels, grid = self.inputs(Image.fromarray(array), ex.text)
            except (ImageError, ValueError, TypeError, AttributeError) as bad:
                res.error = f"invalid example: {bad}"
            else:
                res.prompt_tokens = int(ids.shape[1])
                res.probs = self.probs(ids, pixels, grid)
                res.score = res.probs[0]
                res.decision = "yes" if res.probs[0] >= res.probs[1] else "no"
            results.append(res)
            if progress:
                progress(1)
        return results
