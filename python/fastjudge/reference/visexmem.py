"""The VisExMEM judge as a transformers user writes it: the judge's own stage logic (prompt
builders, JSON schemas, parsing, part-link repair, aggregation -- :class:`TransformersPipeline`
subclasses ``VisExJudge`` and replaces only the model calls), so both sides run exactly the
same prompts and schemas, with every model call made the transformers way:

* the prompt text with one ``<|vision_start|><|image_pad|><|vision_end|>`` per image through the
  chat template (thinking off), the images and crops (PIL crops of the decoded image) through
  ``Qwen2VLImageProcessorPil``, each pad expanded to its image's token count, batches of
  ``batch_size`` prompts left-padded, one schema per batch;
* each JSON stage through ``Qwen3_5ForConditionalGeneration.generate`` (greedy) with
  ``xgrammar.contrib.hf.LogitsProcessor`` on the schema compiled in fastjudge's documented
  output format (no free whitespace, ``", "`` / ``": "`` separators, strict mode) and the special
  tokens other than the stop tokens suppressed (``suppress_tokens``; else xgrammar writes chat
  markers as text inside strings);
* verification (and every other choice step) one forward pass per batch (``logits_to_keep=1``)
  after the forced response start, P(yes) renormalised over {yes, no}.

Every mode (``pipeline``, ``single-response``, ``holistic-score``) runs through these calls.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from ..judges.visexmem import VisExJudge
from ..judges.visexmem.judge import STAGES
from ..runtime.requests import Choice, Image, Output
from .models import PLACEHOLDER, chat_text, expand_image_pads, image_processor, left_padded, load_model

# the judge options the reference copies (the rest only concern fastjudge's own batching)
JUDGE_OPTIONS = ("aggregate", "explain", "propose_boxes", "max_claims", "max_claim_chars",
                 "max_explanation_chars", "evidence_layout", "strict", "image_root", "max_image_pixels", "mode")


@dataclass
class _Prompt:
    """A stage's request as the judge built it, before tokenization."""

    index: int
    parts: tuple  # text and image slots: the shared prefix, then the task
    spec: object  # runtime.grammar.Json or runtime.requests.Choice
    response_prefix: tuple  # forced response tokens after the prompt


class TransformersPipeline(VisExJudge):
    """The judge's stages with every model call made the transformers way (module docstring).
    ``backend``: an open fastjudge backend of the same checkpoint, which only lends the judge its
    codec (prompt structures, schemas' token bounds)."""

    def __init__(self, backend, model_dir, dtype="float32", batch_size: int = 8, device="cpu", **options):
        import xgrammar as xgr

        super().__init__(backend, **options)
        self.device = torch.device(device)
        self.hf, self.tok = load_model(model_dir, dtype, device)
        self.processor, self.merge = image_processor(model_dir)
        self.image_token_id = self.hf.config.image_token_id
        self.batch_size = max(1, int(batch_size))
        self.eos = sorted(self.codec.eos_token_ids)
        special = set(self.tok.all_special_ids) | {i for i, t in self.tok.added_tokens_decoder.items() if t.special}
        self.suppress = sorted(special - set(self.eos))
        info = xgr.TokenizerInfo.from_huggingface(self.tok, vocab_size=self.hf.config.text_config.vocab_size,
                                                  stop_token_ids=self.eos)
        self.compiler, self.grammars = xgr.GrammarCompiler(info), {}
        self.pictures: dict[bytes, tuple] = {}  # image slot key -> (PIL image, crop box or None)
        self.stats = defaultdict(Counter)

    @classmethod
    def like(cls, judge: VisExJudge, model_dir, device="cpu", dtype="float32", batch_size: int = 8):
        """The reference of ``judge``: its options, the checkpoint ``model_dir`` in transformers."""
        ref = cls(judge.backend, model_dir, dtype=dtype, batch_size=batch_size, device=device,
                  **{k: getattr(judge, k) for k in JUDGE_OPTIONS})
        ref.crop_config = judge.crop_config
        return ref

    def _request(self, item, key, prefix, task, spec, response_prefix=()):
        encoded = self.codec.encode(prefix, task)  # the judge's prompt-length policy
        if len(encoded.ids) + len(response_prefix) > self.backend.max_input_tokens:
            raise ValueError(f"prompt is {len(encoded.ids)} tokens, above the model limit of "
                             f"{self.backend.max_input_tokens}")
        item.result.prompt_tokens = max(item.result.prompt_tokens or 0, len(encoded.ids))
        return _Prompt(key, tuple(prefix) + (task if isinstance(task, tuple) else (task,)), spec,
                       tuple(response_prefix))

    def _run(self, stage, requests):
        if not requests:
            return {}
        start = time.perf_counter()
        groups = defaultdict(list)  # a batch shares its schema, as one generate call must
        for r in requests:
            groups[r.spec].append(r)
        outputs = {}
        for same in groups.values():
            for i in range(0, len(same), self.batch_size):
                batch = same[i: i + self.batch_size]
                run = self._choice if isinstance(batch[0].spec, Choice) else self._generate
                outputs.update((o.index, o) for o in run(stage, batch))
        self.stage_seconds[stage] += time.perf_counter() - start
        return outputs

    def _inputs(self, batch: list[_Prompt]) -> dict:
        texts, images = [], []
        for p in batch:
            texts.append(chat_text(self.tok, "".join(PLACEHOLDER if isinstance(s, Image) else s for s in p.parts)))
            for s in p.parts:
                if isinstance(s, Image):
                    picture, box = self.pictures[s.key]
                    images.append(picture if box is None else picture.crop(box))
        kw = {}
        if images:
            enc = self.processor(images=images, return_tensors="pt")
            texts = expand_image_pads(texts, enc["image_grid_thw"], self.merge)
            kw = dict(pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"])
        rows = [self.tok(t, add_special_tokens=False).input_ids + list(p.response_prefix) for t, p in zip(texts, batch)]
        ids, mask = left_padded(rows, self.tok.pad_token_id)
        if images:
            kw["mm_token_type_ids"] = (ids == self.image_token_id).int()
        return {k: v.to(self.device) for k, v in dict(input_ids=ids, attention_mask=mask, **kw).items()}

    def _grammar(self, spec):
        if spec.schema not in self.grammars:  # a user compiles each schema once
            self.grammars[spec.schema] = self.compiler.compile_json_schema(
                spec.schema, any_whitespace=False, separators=(", ", ": "), strict_mode=True)
        return self.grammars[spec.schema]

    @torch.inference_mode()
    def _generate(self, stage: str, batch: list[_Prompt]) -> list[Output]:
        import xgrammar as xgr

        spec, kw = batch[0].spec, self._inputs(batch)
        gen = self.hf.generate(**kw, max_new_tokens=spec.max_new_tokens + 1, do_sample=False, num_beams=1,
                               logits_processor=[xgr.contrib.hf.LogitsProcessor(self._grammar(spec))],
                               suppress_tokens=self.suppress, eos_token_id=self.eos,
                               pad_token_id=self.tok.pad_token_id)[:, kw["input_ids"].shape[1]:].tolist()
        out = []
        for p, row in zip(batch, gen):
            stop = next((i for i, t in enumerate(row) if t in self.eos), None)
            tokens = row[:spec.max_new_tokens if stop is None else stop]
            out.append(Output(index=p.index, token_ids=tokens, finished=stop is not None))
            self.stats[stage]["tokens"] += len(tokens) + (stop is not None)
        self.stats[stage]["steps"] += len(gen[0])
        self.stats[stage]["row_steps"] += len(gen[0]) * len(gen)
        return out

    @torch.inference_mode()
    def _choice(self, stage: str, batch: list[_Prompt]) -> list[Output]:
        logits = self.hf(**self._inputs(batch), logits_to_keep=1).logits[:, -1]
        z = logits[:, list(batch[0].spec.token_ids)].double().cpu()
        probs = torch.softmax(z, -1).numpy()
        return [Output(index=p.index, probs=probs[i], logits=z[i].numpy()) for i, p in enumerate(batch)]

    def run(self, examples) -> list:
        """``score``, with ``stage_seconds`` counted from after the examples are checked (and
        their images decoded and crops placed: the judge's own code)."""
        self.stage_seconds = {s: 0.0 for s in STAGES}
        self.stats.clear()
        items, invalid = self.prepare(examples)
        self._propose(items)
        for it in items:
            picture = _pil(it.image)
            self.pictures[it.full_image.key] = (picture, None)
            self.pictures.update((im.key, (picture, tuple(b))) for b, im in zip(it.boxes, it.box_images))
        start = time.perf_counter()
        run = {"single-response": self._single_response, "holistic-score": self._holistic_score}
        run.get(self.mode, self._pipeline)(items)
        self.stage_seconds["total"] = time.perf_counter() - start
        for it in items:
            if it.result.error:  # as the judge: no partial claims or score
                it.result.claims, it.result.score, it.result.explanation = [], None, None
            else:
                it.result.claims = it.claims
        return sorted(invalid + [it.result for it in items], key=lambda r: r.index)

    def score(self, examples, progress=None) -> list:
        """``run`` over chunks of ``batch_size`` examples (every stage of a chunk before the
        next), ``progress(n)`` after each chunk."""
        examples, results = list(examples), []
        for start in range(0, len(examples), self.batch_size):
            for r in self.run(examples[start: start + self.batch_size]):
                r.index += start
                results.append(r)
            if progress:
                progress(min(self.batch_size, len(examples) - start))
        return results


class ClaimSupportReference:
    """One claim's verification as a transformers user writes it, batch size 1: the whole image
    and the claim's evidence crops (PIL crops) through ``Qwen2VLImageProcessorPil``, the judge's
    prompt text (one ``<|vision_start|><|image_pad|><|vision_end|>`` per image) through the chat
    template with thinking off and the decision prefix after it, each pad expanded to its
    image's token count, one forward pass with ``logits_to_keep=1``; P(yes) renormalised over
    {yes, no} (``yes_no_ids``: the judge's)."""

    def __init__(self, model_dir, dtype="float32", yes_no_ids=(), device="cpu"):
        from ..judges.visexmem import prompts as vx_prompts

        self.device = torch.device(device)
        self.model, self.tok = load_model(model_dir, dtype, device)
        self.processor, self.merge = image_processor(model_dir)
        self.image_token_id = self.model.config.image_token_id
        self.yes_no = list(yes_no_ids)
        self.decision_prefix = vx_prompts.DECISION_PREFIX

    def inputs(self, image, user: str, boxes):
        """``user``: the judge's prompt with one placeholder per image; ``boxes``: the crops
        after the whole image, in prompt order."""
        images = [image] + [image.crop(tuple(b)) for b in boxes]
        enc = self.processor(images=images, return_tensors="pt")
        text = expand_image_pads([chat_text(self.tok, user) + self.decision_prefix], enc["image_grid_thw"],
                                 self.merge)[0]
        ids = self.tok(text, add_special_tokens=False, return_tensors="pt").input_ids
        return ids.to(self.device), enc["pixel_values"].to(self.device), enc["image_grid_thw"].to(self.device)

    @torch.inference_mode()
    def support(self, ids, pixel_values, grid) -> float:
        logits = self.model(input_ids=ids, pixel_values=pixel_values, image_grid_thw=grid,
                            mm_token_type_ids=(ids == self.image_token_id).int(), logits_to_keep=1).logits[0, -1]
        return float(torch.softmax(logits[self.yes_no].double(), 0)[0])


def zero_unmasked_utf8_rows(model_dir) -> list[int]:
    """Make a random-weight checkpoint comparable with this reference: zero the LM-head rows
    of the tokens whose bytes end in a narrow UTF-8 lead byte (``E0``, ``ED``, ``F0``, ``F4``).

    xgrammar (0.2.9) lets a few invalid UTF-8 forms through inside JSON strings (a surrogate
    after ``ED``, overlong forms after ``E0``/``F0``); fastjudge masks them
    (``runtime/grammar.py``), its HF logits processor does not. A trained model practically
    never writes such bytes; random weights do. Zeroed rows give those tokens logit 0, never
    the greedy choice where free text is allowed. Returns the zeroed token ids."""
    import xgrammar as xgr
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    vocab = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(str(model_dir))).decoded_vocab
    rows = [i for i, raw in enumerate(vocab) if raw and raw[-1] in (0xE0, 0xED, 0xF0, 0xF4)]
    path = Path(model_dir) / "model.safetensors"
    state = load_file(str(path))
    state["lm_head.weight"][rows] = 0
    save_file(state, str(path), metadata={"format": "pt"})
    return rows


def _pil(loaded):
    """The judge's decoded image (``LoadedImage``, [3, H, W] uint8) as a PIL image."""
    from PIL import Image as PILImage

    return PILImage.fromarray(loaded.pixels.permute(1, 2, 0).contiguous().numpy())
