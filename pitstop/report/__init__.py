"""Estimates, run comparison and the HTML report (`pitstop estimate | compare | report`)."""

from pitstop.report.compare import compare
from pitstop.report.html import write_report

__all__ = ["compare", "write_report"]
