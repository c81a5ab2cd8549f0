"""``fastjudge report``: one self-contained HTML page of judge outputs (VisExMEM / holistic and
LAVE rows), with a summary over every row, inline SVG charts and no network access."""

from .page import add_report_parser, build_report, run_report

__all__ = ["add_report_parser", "build_report", "run_report"]
