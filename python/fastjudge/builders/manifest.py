"""``fastjudge-engine.json``: what a build produced and how, checked again when it is loaded.

Written by every build into its output directory. Sections:

* ``model``: kind (``flan-t5`` / ``qwen3.5``), the checkpoint's ``model_type`` and architecture;
* ``quantization``: FP8 (E4M3 per-tensor weights, static per-tensor activations), KV cache
  dtype, the layers left unquantized, the tool;
* ``judge``: metric, prompt template version and hash, and the token ids the judge reads:
  ``rating_token_ids`` (ratings 1/2/3 at the start of the answer), ``rationale_rating_token_ids``
  (after " So rating="), for decoder-only judges ``yes_no_token_ids`` (the holistic judge's
  first answer token) and ``decision_token_ids`` (VisExMEM's, after its decision prefix), and
  ``answer_contexts``, where each set is read, so a loader re-derives them knowing no judge;
* ``limits``: the LLM-API limits chosen for the judge (input and sequence length, batch size,
  token budget, generated tokens; ``llm_options.py``);
* ``calibration``: the source, item counts and the sha256 of the calibration and held-out
  prompts;
* ``agreement``: the agreement report (``agreement.py``);
* ``artifacts`` and ``stages``: relative paths of what was written, and which stages ran or were
  skipped and why;
* ``tools``: versions of fastjudge, torch, transformers, ModelOpt, TensorRT-LLM, ONNX.

The ``trtllm`` backend reads it at load and refuses a build whose model kind or token ids do
not match the tokenizer it ships with.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from fastjudge.backends.manifest import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_NAME,
    REQUIRED,
    ManifestError,
    answer_token_ids,
    check_token_ids,
    read_manifest,
)

LAVE_TEMPLATE_VERSION = "lave/1"

__all__ = ["MANIFEST_NAME", "ManifestError", "read_manifest", "check_token_ids", "judge_token_ids",
           "lave_template", "new_manifest", "write_manifest", "tool_versions"]


def lave_template(judge) -> dict:
    """Version and content hash of the judge's prompt template: the fixed texts, the
    demonstrations, and the options that shape prompts."""
    from fastjudge.judges import lave

    content = {"task": lave.TASK_DESCRIPTION, "rationale_instruction": lave.RATIONALE_INSTRUCTION,
               "binary_rule": lave.BINARY_RULE, "cue": lave.RATING_CUE, "rationale": judge.rationale,
               "use_caption": judge.use_caption, "filter_refs": judge.filter_refs, "filter_p": judge.filter_p,
               "general": [asdict(d) for d in judge.general_demos],
               "binary": [asdict(d) for d in judge.binary_demos]}
    digest = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()
    return {"metric": "lave", "template_version": LAVE_TEMPLATE_VERSION, "template_sha256": digest,
            "num_shots": judge.num_shots, "rationale": judge.rationale}


def answer_contexts(kind: str) -> dict:
    """Where each judge reads its answer tokens: the response prefix before them and the answers
    (recorded in the manifest, so a loader can re-derive the ids without knowing the judges)."""
    from fastjudge.judges.lave import RATING_CUE, RATINGS
    from fastjudge.judges.visexmem import DECISION_PREFIX

    ratings = [str(r) for r in RATINGS]
    contexts = {"rating_token_ids": {"after": "", "answers": ratings, "single_token": True},
                "rationale_rating_token_ids": {"after": RATING_CUE, "answers": ratings, "single_token": True}}
    if kind == "decoder-only":
        # the holistic judge reads yes/no as the first answer token; VisExMEM after its decision prefix
        contexts["yes_no_token_ids"] = {"after": "", "answers": ["yes", "no"], "single_token": True}
        contexts["decision_token_ids"] = {"after": DECISION_PREFIX, "answers": ["yes", "no"], "single_token": False}
    return contexts


def judge_token_ids(codec) -> dict:
    """The judge section's token entries: each answer set's ids as the judges derive them
    (``PromptCodec.answer_ids``), and ``answer_contexts``, where they are read."""
    contexts = answer_contexts(codec.kind)
    return {**answer_token_ids(codec, contexts), "answer_contexts": contexts}


def tool_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name, dist in (("fastjudge", "fastjudge"), ("torch", "torch"), ("transformers", "transformers"),
                       ("modelopt", "nvidia-modelopt"), ("tensorrt_llm", "tensorrt_llm"), ("onnx", "onnx"),
                       ("onnxruntime", "onnxruntime")):
        try:
            out[name] = version(dist)
        except PackageNotFoundError:
            out[name] = None
    return out


def new_manifest(**sections) -> dict:
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION,
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    manifest.update(sections)
    manifest.setdefault("tools", tool_versions())
    return manifest


def write_manifest(out_dir: str | os.PathLike, manifest: dict) -> Path:
    missing = [k for k in REQUIRED if k not in manifest]
    if missing:
        raise ManifestError(f"manifest lacks {missing}")
    path = Path(out_dir) / MANIFEST_NAME
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=False))
    tmp.replace(path)
    return path
