"""Observability: per-step metrics, phase timing and trace spans (``metrics``), PNG report (``report``).

The report module imports matplotlib; import it explicitly (``rollplex.observe.report``) where needed.
"""

from rollplex.observe.metrics import (
    MetricsWriter,
    PhaseTimer,
    ProgressBar,
    Span,
    read_metrics,
    write_chrome_trace,
)

__all__ = ["MetricsWriter", "PhaseTimer", "ProgressBar", "Span", "read_metrics", "write_chrome_trace"]
