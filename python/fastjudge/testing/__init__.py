"""Plain-Python twins of the C++ host core, for tests and benchmark baselines.

The library runs ``fastjudge._engine``; nothing in it imports this package. Each twin follows
the contract in the docstring of the runtime module it mirrors, with the same results and
errors, so tests can compare the two on random inputs and ``benchmarks/bench_planner.py`` can
time the C++ core against a straightforward Python loop in the same run.

* :func:`plan_batches_python` -- :func:`fastjudge.runtime.planner.plan_batches`.
* :class:`PrefixIndexPython` -- :class:`fastjudge.runtime.prefix_index.PrefixIndex`.

``vqa_eval_script.script_accuracy``: the official VQA script's per-question loop, the reference
for ``fastjudge.metrics.vqa``.
"""

from .planner import plan_batches_python
from .prefix_index import PrefixIndexPython

__all__ = ["PrefixIndexPython", "plan_batches_python"]
