"""The VisExMEM pipeline as a transformers user writes it, for ``bench_visexmem_e2e.py``: the
judge's own stage logic (prompt builders, JSON schemas, parsing, part-link repair,
aggregation) with every model call made through transformers and xgrammar's HF logits
processor (details in ``bench_visexmem_e2e``'s docstring)."""

from __future__ import annotations

import json
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from bench_visexmem import IMAGE_PAD, PLACEHOLDER

from fastjudge import VisExJudge
from fastjudge.judges.visexmem.judge import STAGES
from fastjudge.runtime.requests import Choice, Image, Output


@dataclass
class _Prompt:
    """A stage's request as the judge built it, before tokenization."""

    index: int
    parts: tuple  # text and image slots: the shared prefix, then the task
    spec: object  # runtime.grammar.Json or runtime.requests.Choice
    answer_start: bool  # the verification answer's forced start follows the prompt


class TransformersPipeline(VisExJudge):
    """The judge's stages with every model call made the transformers way (module docstring)."""

    def __init__(self, backend, model_dir: Path, dtype: torch.dtype, batch_size: int, device="cpu", **options):
        import xgrammar as xgr
        from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen3_5ForConditionalGeneration

        super().__init__(backend, **options)  # the backend only lends the judge its codec
        self.device = torch.device(device)
        self.hf = Qwen3_5ForConditionalGeneration.from_pretrained(str(model_dir), dtype=dtype).eval().to(self.device)
        self.tok = AutoTokenizer.from_pretrained(str(model_dir))
        pre = json.loads((model_dir / "preprocessor_config.json").read_text())
        pre.pop("image_processor_type", None)
        self.processor = Qwen2VLImageProcessorPil(**pre)
        self.merge = pre["merge_size"]
        self.image_token_id = self.hf.config.image_token_id
        self.batch_size = batch_size
        self.eos = sorted(self.codec.eos_token_ids)
        special = set(self.tok.all_special_ids) | {i for i, t in self.tok.added_tokens_decoder.items() if t.special}
        self.suppress = sorted(special - set(self.eos))
        info = xgr.TokenizerInfo.from_huggingface(self.tok, vocab_size=self.hf.config.text_config.vocab_size,
                                                  stop_token_ids=self.eos)
        self.compiler, self.grammars = xgr.GrammarCompiler(info), {}
        self.pictures: dict[bytes, tuple] = {}  # image slot key -> (PIL image, crop box or None)
        self.stats = defaultdict(Counter)

    def _request(self, item, key, prefix, task, spec, response_prefix=()):
        return _Prompt(key, tuple(prefix) + (task if isinstance(task, tuple) else (task,)), spec,
                       bool(response_prefix))

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
            user = "".join(PLACEHOLDER if isinstance(s, Image) else s for s in p.parts)
            text = self.tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                                add_generation_prompt=True, enable_thinking=False)
            texts.append(text)
            for s in p.parts:
                if isinstance(s, Image):
                    picture, box = self.pictures[s.key]
                    images.append(picture if box is None else picture.crop(box))
        kw = {}
        if images:
            enc = self.processor(images=images, return_tensors="pt")
            counts = iter((enc["image_grid_thw"].prod(-1) // self.merge ** 2).tolist())
            texts = [t.split(IMAGE_PAD)[0] + "".join(IMAGE_PAD * next(counts) + rest for rest in t.split(IMAGE_PAD)[1:])
                     for t in texts]
            kw = dict(pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"])
        rows = [self.tok(t, add_special_tokens=False).input_ids + (list(self.decision_prefix) if p.answer_start else [])
                for t, p in zip(texts, batch)]
        width = max(map(len, rows))
        ids = torch.tensor([[self.tok.pad_token_id] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
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
        """``score``, with the clock started after the examples are checked and the prompts'
        image slots are in place (the judge's own code)."""
        self.stage_seconds = {s: 0.0 for s in STAGES}
        self.stats.clear()
        items, invalid = self.prepare(examples)
        self._propose(items)
        for it in items:
            picture = examples[it.index].image
            self.pictures[it.full_image.key] = (picture, None)
            self.pictures.update((im.key, (picture, tuple(b))) for b, im in zip(it.boxes, it.box_images))
        start = time.perf_counter()
        self._pipeline(items)
        self.stage_seconds["total"] = time.perf_counter() - start
        for it in items:
            it.result.claims = [] if it.result.error else it.claims
        return sorted(invalid + [it.result for it in items], key=lambda r: r.index)
