"""Reports of an analysis: report.json (``json_report``), report.md (``markdown``), plots."""
