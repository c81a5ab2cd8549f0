"""fastjudge: a compiled high-throughput inference engine for model-as-judge metrics."""

from .judges.holistic import HolisticJudge, HolisticResult
from .judges.lave import LaveJudge, LaveResult, VQAExample
from .judges.visexmem import ClaimResult, ImageTextExample, VisExJudge, VisExResult

__version__ = "0.1.0"

__all__ = ["LaveJudge", "LaveResult", "VQAExample", "VisExJudge", "VisExResult", "ClaimResult",
           "ImageTextExample", "HolisticJudge", "HolisticResult", "__version__"]
