"""``fastjudge-engine.json``: what a build produced and how, checked again when it is loaded.

Written by every build into its output directory. Sections:

* ``model``: kind (``flan-t5`` / ``qwen3.5``), the checkpoint's ``model_type`` and architecture;
* ``quantization``: FP8 (E4M3 per-tensor weights, static per-tensor activations), KV cache
  dtype, the layers left unquantized, the tool;
* ``judge``: metric, prompt template version and hash, and the token ids the judge reads:
  ``rating_token_ids`` (ratings 1/2/3 at the start of the answer), ``rationale_rating_token_ids``
  (after " So rating="), ``yes_no_token_ids`` (decoder-only judges);
* ``limits``: engine limits chosen for the judge (input length, batch size, decoder length);
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

MANIFEST_NAME = "fastjudge-engine.json"
FORMAT = "fastjudge-engine"
FORMAT_VERSION = 1
LAVE_TEMPLATE_VERSION = "lave/1"
REQUIRED = ("format", "format_version", "model", "quantization", "judge", "limits", "calibration",
            "artifacts", "tools")


class ManifestError(ValueError):
    """A build directory whose manifest is missing, malformed or does not match."""


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


def judge_token_ids(backend) -> dict:
    """The token ids judges read, derived from a backend's tokenization exactly as the judges
    derive them: each rating as the first response token and after the rating cue, and (for
    decoder-only judges) "yes"/"no" as the first response token."""
    from fastjudge.judges.lave import RATING_CUE, RATINGS

    def single(text: str, context: str = "") -> int | None:
        base = backend.response_ids(context) if context else []
        full = backend.response_ids(context + text)
        return full[-1] if full[: len(base)] == base and len(full) == len(base) + 1 else None

    ids = {"rating_token_ids": [single(str(r)) for r in RATINGS],
           "rationale_rating_token_ids": [single(str(r), RATING_CUE) for r in RATINGS]}
    if getattr(backend, "kind", "") == "decoder-only":
        ids["yes_no_token_ids"] = [single("yes"), single("no")]
    return ids


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


def read_manifest(build_dir: str | os.PathLike) -> dict:
    """The manifest of a build directory, validated for format and required sections."""
    path = Path(build_dir) / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(f"{build_dir}: no {MANIFEST_NAME}; is this a `fastjudge build` output directory?")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as bad:
        raise ManifestError(f"{path}: not valid JSON ({bad})") from None
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise ManifestError(f"{path}: format {manifest.get('format')!r} version {manifest.get('format_version')!r}; "
                            f"this fastjudge reads {FORMAT!r} version {FORMAT_VERSION}")
    missing = [k for k in REQUIRED if k not in manifest]
    if missing:
        raise ManifestError(f"{path}: missing sections {missing}")
    return manifest


def check_token_ids(manifest: dict, backend_ids: dict) -> None:
    """Raise ManifestError when the manifest's token ids differ from the ids the tokenizer gives
    (``judge_token_ids`` of the backend being loaded)."""
    judge = manifest["judge"]
    for key, ids in backend_ids.items():
        if key in judge and list(judge[key]) != list(ids):
            raise ManifestError(f"manifest {key} {judge[key]} != {list(ids)} from the tokenizer: the engine "
                                "was built for another tokenizer or template; rebuild it")
