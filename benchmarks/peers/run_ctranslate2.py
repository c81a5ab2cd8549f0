"""CTranslate2 side of the peer benchmark: run a workload file on a Flan-T5 checkpoint.

Runs in CTranslate2's own environment (``install_ctranslate2.sh``) and imports nothing from
fastjudge. The checkpoint is converted once with CTranslate2's transformers converter (float32
weights; ``int8`` is applied at load, as ``compute_type``), then for each compute type, each
workload and each ``max_batch_size`` of ``--batch-sizes`` (the setting CTranslate2's users tune:
one batch of every item is not necessarily its fastest), one untimed warm-up and the timed
runs; per compute type and workload the batch size with the lowest median is kept
(``common.keep_best``), the others' medians listed with it:

* ``choice`` (score-only): ``translate_batch`` with the response prefix as ``target_prefix``,
  one decoding step past it, ``return_logits_vocab=True``: the step's vocabulary logits, read at
  the candidate ids (``min_decoding_length=0``, so EOS is not masked at that step);
* ``text`` (rationale): greedy ``translate_batch`` (``beam_size=1``) up to ``max_new_tokens``.

Token ids go in and come out through the converted model's own vocabulary file, so CTranslate2
runs exactly the ids fastjudge runs (``unique_vocabulary`` first gives every row its own name),
with ``max_input_length=0`` (its default cuts inputs at 1024 tokens).
Writes ``{"engine", "version", "runs": [...]}`` as JSON.

    python run_ctranslate2.py WORKLOADS.json OUT.json --compute-types float32 int8 --batch-sizes 8 16 32 64
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

from common import keep_best, settings_to_try  # the script's directory: stdlib and numpy only


def t5_loader_for_transformers_5() -> None:
    """Make CTranslate2's T5 converter rescale the decoder output only where transformers does.

    transformers 5 reads every T5 config back with ``tie_word_embeddings=True`` and keeps the
    rescaling of the head's input by ``d_model**-0.5`` in ``scale_decoder_outputs`` (False for
    Flan-T5's untied head). CTranslate2 4.8.5's ``T5Loader.get_model_spec`` rescales whenever
    ``tie_word_embeddings`` is set, so a Flan-T5 converted under transformers 5 would give
    logits 1/sqrt(d_model) of the model's. Where the config says ``scale_decoder_outputs``,
    that is what the converted model does."""
    from ctranslate2.converters import transformers as ct2_transformers
    from ctranslate2.specs import model_spec

    base = type(ct2_transformers._MODEL_LOADERS["T5Config"])

    class T5Loader(base):
        def get_model_spec(self, model):
            spec = super().get_model_spec(model)
            scale = getattr(model.config, "scale_decoder_outputs", None)
            if scale is not None:
                spec.decoder.scale_outputs = model.config.d_model**-0.5 if scale else model_spec.OPTIONAL
            return spec

    ct2_transformers._MODEL_LOADERS["T5Config"] = T5Loader()


def converted(model_dir: str, cache_dir: Path) -> Path:
    """The CTranslate2 model directory of ``model_dir``, converted on first use (float32)."""
    import ctranslate2

    weights = Path(model_dir) / "model.safetensors"
    key = hashlib.sha256(weights.read_bytes()).hexdigest()[:16]
    out = cache_dir / f"t5-{key}"
    if not (out / "model.bin").exists():
        t5_loader_for_transformers_5()
        converter = ctranslate2.converters.TransformersConverter(model_dir)
        converter.convert(str(out), quantization="float32", force=True)
        unique_vocabulary(out)
    return out


def unique_vocabulary(ct2_dir: Path) -> None:
    """Give every row of the converted vocabulary its own name. The converter names the rows
    past the tokenizer (Flan-T5 has 32128 rows for 32100 tokens) with names the tokenizer
    already uses, so token strings would not map back to one id; renaming those rows changes
    nothing in the model (CTranslate2 maps strings to rows through this file only)."""
    path = ct2_dir / "shared_vocabulary.json"
    if not path.exists():
        return
    tokens = json.loads(path.read_text())
    seen = set(tokens)
    first: set[str] = set()
    for i, token in enumerate(tokens):
        if token in first:
            name = f"<row_{i}>"
            while name in seen:
                name = "<" + name + ">"
            tokens[i] = name
            seen.add(name)
        first.add(token)
    path.write_text(json.dumps(tokens))


def vocabulary(ct2_dir: Path) -> list[str]:
    for name in ("shared_vocabulary.json", "target_vocabulary.json"):
        path = ct2_dir / name
        if path.exists():
            return json.loads(path.read_text())
    for name in ("shared_vocabulary.txt", "target_vocabulary.txt"):
        path = ct2_dir / name
        if path.exists():
            return path.read_text(encoding="utf-8").split("\n")[:-1]
    raise FileNotFoundError(f"no vocabulary file in {ct2_dir}")


class Vocab:
    """ids <-> CTranslate2 token strings, refusing a vocabulary where the map is not one to one."""

    def __init__(self, tokens: list[str]):
        self.tokens = tokens
        self.ids = {t: i for i, t in enumerate(tokens)}
        if len(self.ids) != len(tokens):
            raise ValueError("the converted vocabulary repeats tokens: ids would not round-trip")

    def to_tokens(self, ids) -> list[str]:
        return [self.tokens[i] for i in ids]

    def to_ids(self, tokens) -> list[int]:
        return [self.ids[t] for t in tokens]


def run_choice(translator, vocab: Vocab, workload: dict, batch_size: int) -> list[dict]:
    sources = [vocab.to_tokens(r["prompt_ids"]) for r in workload["requests"]]
    prefixes = [vocab.to_tokens(r["response_prefix"]) for r in workload["requests"]]
    steps = max(len(p) for p in prefixes) + 1
    results = translator.translate_batch(
        sources, target_prefix=prefixes if any(prefixes) else None, beam_size=1, max_input_length=0,
        max_decoding_length=steps, min_decoding_length=0, return_logits_vocab=True,
        return_scores=False, max_batch_size=batch_size)
    import numpy as np

    choice = workload["choice_ids"]
    outputs = []
    for result, prefix in zip(results, prefixes):
        # one logits row per decoding step, the prefix's included: the step after it is read
        row = np.asarray(result.logits[0][len(prefix)])
        outputs.append({"logits": [float(row[i]) for i in choice]})
    return outputs


def run_text(translator, vocab: Vocab, workload: dict, batch_size: int) -> list[dict]:
    sources = [vocab.to_tokens(r["prompt_ids"]) for r in workload["requests"]]
    results = translator.translate_batch(
        sources, beam_size=1, max_decoding_length=workload["max_new_tokens"], max_input_length=0,
        return_scores=False, max_batch_size=batch_size)
    return [{"token_ids": vocab.to_ids(r.hypotheses[0])} for r in results]


def timed(fn, repeats: int) -> tuple[list[float], object]:
    """Wall times of ``repeats`` runs after one untimed warm-up; the last run's outputs."""
    times, out = [], None
    for i in range(repeats + 1):
        start = time.perf_counter()
        out = fn()
        if i:
            times.append(time.perf_counter() - start)
    return times, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workloads")
    ap.add_argument("out")
    ap.add_argument("--compute-types", nargs="+", default=["float32", "int8"])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[8, 16, 32, 64],
                    help="max_batch_size values to try per workload; the fastest is kept")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--cache-dir", default=None, help="converted models (default: next to OUT)")
    args = ap.parse_args(argv)

    import ctranslate2

    data = json.loads(Path(args.workloads).read_text())
    settings = data["settings"]
    threads, repeats = int(settings["threads"]), int(settings["repeats"])
    cache = Path(args.cache_dir or Path(args.out).parent / "ct2-models")
    runs = []
    for compute_type in args.compute_types:
        translators = {}
        for index, workload in enumerate(data["workloads"]):
            model_dir = workload["model_dir"]
            if model_dir not in translators:
                ct2_dir = converted(model_dir, cache)
                translators[model_dir] = (
                    ctranslate2.Translator(str(ct2_dir), device=args.device, compute_type=compute_type,
                                           intra_threads=threads, inter_threads=1),
                    Vocab(vocabulary(ct2_dir)))
            translator, vocab = translators[model_dir]
            run = run_choice if workload["kind"] == "choice" else run_text
            if workload["kind"] == "json":
                raise ValueError("CTranslate2 has no grammar-constrained decoding: no json workloads")
            for batch_size in settings_to_try(args.batch_sizes, len(workload["requests"])):
                times, outputs = timed(lambda: run(translator, vocab, workload, batch_size), repeats)
                runs.append({"index": index, "variant": compute_type, "value": batch_size,
                             "workload": workload["name"], "times": times, "outputs": outputs})
                print(f"[ctranslate2 {compute_type} batch {batch_size}] {workload['name']}: median "
                      f"{statistics.median(times):.3f}s", file=sys.stderr)
        del translators
    import torch
    import transformers

    Path(args.out).write_text(json.dumps({
        "engine": "ctranslate2", "version": ctranslate2.__version__, "runs": keep_best(runs, "batch"),
        "versions": {"converter's transformers": transformers.__version__, "torch": torch.__version__}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
