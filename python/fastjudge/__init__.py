"""fastjudge: a compiled high-throughput inference engine for model-as-judge metrics."""

from .judges.lave import LaveJudge, LaveResult, VQAExample

__version__ = "0.1.0"

__all__ = ["LaveJudge", "LaveResult", "VQAExample", "__version__"]
