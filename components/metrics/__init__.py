"""`evaluate` metric modules kept in the repo and loaded by path (the Hub is unreachable).

Each module file is an `evaluate.Metric`; `load_metric(name)` loads it offline.
"""

from __future__ import annotations

from pathlib import Path

METRICS_DIR = Path(__file__).parent


def load_metric(name: str):
    import evaluate

    return evaluate.load(str(METRICS_DIR / f"{name}.py"))
