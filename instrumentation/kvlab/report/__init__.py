"""The before/after HTML report: plotly figures of a lab run in one self-contained file."""

from kvlab.report.html import write_report

__all__ = ["write_report"]
