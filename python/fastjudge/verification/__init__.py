"""Proof of faithfulness on the user's own checkpoint, items and hardware: ``fastjudge
verify`` and :func:`verify` (see docs/verification.md)."""

from __future__ import annotations

import argparse

from .compare import BFLOAT16, FLOAT32, FP8_BUILD, Tolerance, default_tolerance
from .run import VerifyReport, build_judge, format_report

__all__ = ["verify", "VerifyReport", "Tolerance", "FLOAT32", "BFLOAT16", "FP8_BUILD", "default_tolerance",
           "build_judge", "format_report"]


def verify(judge: str, model, input, *, sample: int = 64, seed: int = 0, tolerance: float | None = None,
           min_agreement: float | None = None, build=None, reference_batch_size: int = 8,
           json: str | None = None, progress: bool = True, print_report: bool = False, **options) -> VerifyReport:
    """``fastjudge verify`` from Python: ``judge`` is "lave", "visexmem" or "holistic";
    ``options`` are that judge's command options and the engine's (the fields of
    :class:`~fastjudge.engine_options.EngineOptions`) by keyword (``dtype="bfloat16"``,
    ``rationale=True``, ``official_repo=...``, ``mode="single-response"``...), defaults as on the
    command line. Returns the report (``.passed``; ``.comparisons`` per pair of paths)."""
    from ..engine_options import engine_fields
    from ..judges.registry import get_judge
    from .run import format_report as fmt
    from .run import run_verify as run

    spec = get_judge(judge)
    defaults = {o.name: o.default for o in spec.options} | {f.name: f.default for f in engine_fields()}
    unknown = set(options) - set(defaults)
    if unknown:
        raise TypeError(f"unknown option(s) for the {judge} judge: {', '.join(sorted(unknown))}")
    values = defaults | options
    args = argparse.Namespace(model=str(model), input=str(input), sample=sample, seed=seed, tolerance=tolerance,
                              min_agreement=min_agreement, build=build, reference_batch_size=reference_batch_size,
                              **values)
    report = run(judge, args, progress=progress)
    if print_report:
        print(fmt(report))
    if json:
        import json as _json
        from pathlib import Path

        Path(json).write_text(_json.dumps(report.to_dict(), indent=2, default=str))
    return report
