"""Reading a ``fastjudge build`` output directory's manifest (``fastjudge-engine.json``), as the
trtllm backend does at load: the format, the required sections, and the answer token ids the
judges will read, re-derived from the shipped tokenizer through the prompt codec. Builds write
it with ``fastjudge.builders.manifest``, which documents the sections."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger("fastjudge")

MANIFEST_NAME = "fastjudge-engine.json"
FORMAT = "fastjudge-engine"
FORMAT_VERSION = 1
REQUIRED = ("format", "format_version", "model", "quantization", "judge", "limits", "calibration",
            "artifacts", "tools")


class ManifestError(ValueError):
    """A build directory whose manifest is missing, malformed or does not match."""


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


def answer_token_ids(codec, contexts: dict) -> dict:
    """Token ids of each recorded answer set: ``contexts`` maps a name to ``{"after": response
    prefix, "answers": [...], "single_token": bool}``; None where the tokenizer cannot give them
    (``PromptCodec.answer_ids`` raised)."""
    ids = {}
    for name, c in contexts.items():
        try:
            ids[name] = list(codec.answer_ids(c["answers"], c["after"], single_token=c["single_token"]).ids)
        except ValueError:
            ids[name] = None
    return ids


def check_token_ids(manifest: dict, codec) -> None:
    """Raise ManifestError when the manifest's answer token ids differ from the ids the codec
    gives in the recorded contexts (the engine was built for another tokenizer or template)."""
    judge = manifest["judge"]
    contexts = judge.get("answer_contexts")
    if contexts is None:
        log.warning("fastjudge: %s records no answer contexts (an older build); its token ids are not "
                    "re-checked against the tokenizer", MANIFEST_NAME)
        return
    for key, ids in answer_token_ids(codec, contexts).items():
        if key in judge and judge[key] != ids:
            raise ManifestError(f"manifest {key} {judge[key]} != {ids} from the tokenizer: the engine "
                                "was built for another tokenizer or template; rebuild it")
