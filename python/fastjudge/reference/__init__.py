"""The reference implementations fastjudge is measured against, in one place.

Each runs a judge's metric the way its reference does it -- Hugging Face transformers on the
same checkpoint and prompts, the LAVE authors' scoring loop, t2v_metrics' VQAScore steps,
the VisExMEM stages through transformers ``generate`` with xgrammar -- and returns the judge's
own result objects, so that ``fastjudge verify``, the benchmarks and the tests compare like
with like. Nothing here is on fastjudge's fast path: these are the slow, obvious versions.

* :mod:`.models`: loading a checkpoint into transformers (and its image processor);
* :mod:`.lave`: LAVE score-only and rationale (:class:`TransformersLave`) and the authors'
  ``batch_compute`` path (:class:`AuthorsLave`);
* :mod:`.holistic`: VQAScore as t2v_metrics computes it, one pair at a time
  (:class:`VQAScoreReference`);
* :mod:`.visexmem`: the VisExMEM stages with every model call made through transformers and
  xgrammar (:class:`TransformersPipeline`), and one claim's verification at batch size 1
  (:class:`ClaimSupportReference`, the verification benchmark's baseline).

The judge-level classes take their judge (for the prompt text, the rating rule's settings and
the schemas) and a checkpoint directory, and have ``score(examples, progress=None) -> list`` of
that judge's result type; ``progress(n)`` is called as items finish.
"""

from __future__ import annotations

__all__ = ["reference_for"]


def reference_for(judge, model_dir, *, device="cpu", dtype="float32", batch_size: int = 8):
    """The reference path of ``judge``'s metric and mode on the checkpoint ``model_dir``."""
    from ..judges.holistic import HolisticJudge
    from ..judges.lave import LaveJudge
    from ..judges.visexmem import VisExJudge

    if isinstance(judge, LaveJudge):
        from ..judges.lave_official import OfficialLave
        from .lave import AuthorsLave, TransformersLave

        cls = AuthorsLave if isinstance(judge.style, OfficialLave) else TransformersLave
        return cls(model_dir, judge, device=device, dtype=dtype, batch_size=batch_size)
    if isinstance(judge, HolisticJudge):
        from .holistic import VQAScoreReference

        return VQAScoreReference(model_dir, judge, device=device, dtype=dtype)
    if isinstance(judge, VisExJudge):
        from .visexmem import TransformersPipeline

        return TransformersPipeline.like(judge, model_dir, device=device, dtype=dtype, batch_size=batch_size)
    raise TypeError(f"no reference path for {type(judge).__name__}")
