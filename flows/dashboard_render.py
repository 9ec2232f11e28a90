"""The kiln serve dashboard drawn from a real Prometheus's data, panel by panel as Grafana
lays them out: for the documentation, and for a person with Prometheus but no Grafana.
Each panel's queries are the dashboard's own, asked through Prometheus's HTTP API."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx

from components.errors import KilnError

GRID_COLUMNS = 24  # Grafana's grid width
WIDTH_IN, UNIT_IN = 18.0, 0.3  # the figure's width; the height of one grid unit (inches)
# Room inside a panel's cell for its title, tick labels and axis label (inches).
_PAD_TOP, _PAD_BOTTOM, _PAD_LEFT, _PAD_RIGHT = 0.3, 0.3, 0.75, 0.15
_LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


@dataclass(frozen=True)
class Series:
    legend: str
    times: list[datetime]
    values: list[float]


def render(board: dict, prometheus_url: str, out: Path, minutes: float = 15.0, rate_interval: str = "1m", end: float | None = None) -> dict[str, int]:
    """Draw every panel of `board` over the `minutes` before `end` (Unix seconds; default
    now) into the PNG `out`; returns how many series each panel got (0: "No data")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = end or datetime.now(UTC).timestamp()
    start = end - minutes * 60
    panels = board["panels"]
    height_in = (max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels) + 2) * UNIT_IN
    figure = plt.figure(figsize=(WIDTH_IN, height_in))
    found = {}
    with httpx.Client(base_url=prometheus_url, timeout=30) as client:
        for panel in panels:
            axes = figure.add_axes(_box(panel["gridPos"], height_in, row=panel["type"] == "row"))
            if panel["type"] == "row":
                _draw_row(axes, panel["title"])
                continue
            series = [s for target in panel.get("targets") or [] for s in _query_range(client, target, start, end, rate_interval)]
            found[panel["title"]] = len(series)
            _draw_panel(axes, panel, series)
    stamp = datetime.fromtimestamp(end, UTC).strftime("%Y-%m-%d %H:%M UTC")
    figure.text(0.01, 1 - 0.5 * UNIT_IN / height_in, f"{board['title']} — the last {minutes:g} minutes from {prometheus_url} ({stamp}); drawn by `kiln monitoring --render`, not Grafana", fontsize=12, va="center")
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=80, bbox_inches="tight")
    plt.close(figure)
    return found


def _query_range(client: httpx.Client, target: dict, start: float, end: float, rate_interval: str) -> list[Series]:
    expr = target["expr"].replace("$__rate_interval", rate_interval).replace("$version", ".*")
    step = max((end - start) / 300, 1.0)
    try:
        answer = client.get("/api/v1/query_range", params={"query": expr, "start": start, "end": end, "step": step}).json()
    except (httpx.HTTPError, ValueError) as err:
        raise KilnError(f"Prometheus at {client.base_url} did not answer a query ({err})") from None
    if answer.get("status") != "success":
        raise KilnError(f"Prometheus refused the dashboard query {expr!r}: {answer.get('error')}")
    return [
        Series(
            legend=_LEGEND_LABEL.sub(lambda m: result["metric"].get(m.group(1), ""), target.get("legendFormat") or expr),
            times=[datetime.fromtimestamp(float(t), UTC) for t, _ in result["values"]],
            values=[float(v) for _, v in result["values"]],
        )
        for result in answer["data"]["result"]
    ]


def _box(pos: dict, height_in: float, row: bool) -> list[float]:
    """A panel's axes in figure fractions, from its Grafana grid position (y grows downward,
    below a title line of two units)."""
    left = pos["x"] * WIDTH_IN / GRID_COLUMNS
    top = (pos["y"] + 2) * UNIT_IN
    width, height = pos["w"] * WIDTH_IN / GRID_COLUMNS, pos["h"] * UNIT_IN
    if not row:
        left, top, width, height = left + _PAD_LEFT, top + _PAD_TOP, width - _PAD_LEFT - _PAD_RIGHT, height - _PAD_TOP - _PAD_BOTTOM
    return [left / WIDTH_IN, 1 - (top + height) / height_in, width / WIDTH_IN, height / height_in]


def _draw_row(axes, title: str) -> None:
    axes.axis("off")
    axes.text(0.005, 0.5, title, fontsize=13, fontweight="bold", va="center")


def _draw_panel(axes, panel: dict, series: list[Series]) -> None:
    axes.set_title(panel["title"], fontsize=9, loc="left")
    if not series:
        axes.set_xticks([])
        axes.set_yticks([])
        axes.text(0.5, 0.5, "No data", ha="center", va="center", color="grey", transform=axes.transAxes)
        return
    if panel["type"] == "stat":  # the legends of the series present at the end, as the served-version panel shows them
        latest = max(s.times[-1] for s in series)
        axes.axis("off")
        axes.text(0.5, 0.5, "\n".join(s.legend for s in series if s.times[-1] == latest), ha="center", va="center", fontsize=12, transform=axes.transAxes)
        return
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
    scale, label = _UNITS.get(unit, (1.0, unit or ""))
    for s in series:
        axes.plot(s.times, [v * scale for v in s.values], label=s.legend, linewidth=1.2)
    axes.set_ylabel(label, fontsize=8)
    axes.tick_params(labelsize=7)
    axes.xaxis.set_major_formatter(_time_formatter())
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, loc="upper left")


# Grafana's unit → (factor, axis label) for the units kiln's panels use.
_UNITS = {"s": (1000.0, "ms"), "percentunit": (100.0, "%"), "bytes": (1 / 2**20, "MiB"), "reqps": (1.0, "requests / s"), "h": (1.0, "hours"), "short": (1.0, "")}


def _time_formatter():
    from matplotlib.dates import DateFormatter

    return DateFormatter("%H:%M")
