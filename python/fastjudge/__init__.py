"""fastjudge: a compiled high-throughput inference engine for model-as-judge metrics.

The judges below are imported on first use (PEP 562), so ``import fastjudge.metrics`` and the
other model-free parts load without torch or transformers installed.
"""

import importlib

__version__ = "0.1.0"

#: Public name -> the module that defines it.
_LAZY_EXPORTS = {
    "EngineOptions": "fastjudge.engine_options",
    "HolisticJudge": "fastjudge.judges.holistic",
    "HolisticResult": "fastjudge.judges.holistic",
    "LaveJudge": "fastjudge.judges.lave",
    "LaveResult": "fastjudge.judges.lave",
    "VQAExample": "fastjudge.judges.lave",
    "ClaimResult": "fastjudge.judges.visexmem",
    "ImageTextExample": "fastjudge.judges.visexmem",
    "VisExJudge": "fastjudge.judges.visexmem",
    "VisExResult": "fastjudge.judges.visexmem",
    "verify": "fastjudge.verification",
}

__all__ = ["EngineOptions", "LaveJudge", "LaveResult", "VQAExample", "VisExJudge", "VisExResult", "ClaimResult",
           "ImageTextExample", "HolisticJudge", "HolisticResult", "verify", "__version__"]


def __getattr__(name: str):
    module = _LAZY_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
