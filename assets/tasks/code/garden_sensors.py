"""Readings from the soil sensors of a community garden.

Original code written for the Page-EntroKV task set (CC0). The sensors, the
thresholds and the station names are all made up.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

DEFAULT_SAMPLE_INTERVAL_S = 45
MAX_VALID_RAW = 1023
FROST_WARNING_C = 2.5
STATION_NAMES = {
    "A1": "herb spiral",
    "A2": "bean rows",
    "B1": "orchard corner",
    "B2": "pond edge",
    "C1": "polytunnel",
}


@dataclass(frozen=True)
class Reading:
    """One sample from one station."""

    station: str
    timestamp: int
    moisture_raw: int
    temperature_c: float
    battery_v: float


def is_valid(reading: Reading) -> bool:
    """Reject samples that the hardware cannot have produced."""
    if not 0 <= reading.moisture_raw <= MAX_VALID_RAW:
        return False
    if not -30.0 <= reading.temperature_c <= 60.0:
        return False
    return reading.battery_v > 0


def classify_moisture(raw: int) -> str:
    """Name the moisture level of a raw capacitive reading.

    Higher raw values mean wetter soil on these sensors.
    """
    if raw < 140:
        return "parched"
    if raw < 310:
        return "dry"
    if raw < 620:
        return "moist"
    if raw < 880:
        return "wet"
    return "waterlogged"


def battery_status(volts: float) -> str:
    """Battery state shown on the dashboard."""
    if volts >= 3.9:
        return "full"
    if volts >= 3.6:
        return "ok"
    if volts >= 3.3:
        return "low"
    return "replace"


def frost_risk(readings: Iterable[Reading]) -> bool:
    """True if any reading is at or below the frost warning temperature."""
    return any(r.temperature_c <= FROST_WARNING_C for r in readings)


def moisture_percent(raw: int) -> float:
    """Map a raw reading to a rough percentage for display."""
    clipped = min(max(raw, 0), MAX_VALID_RAW)
    return round(100.0 * clipped / MAX_VALID_RAW, 1)


def group_by_station(readings: Iterable[Reading]) -> dict[str, list[Reading]]:
    groups: dict[str, list[Reading]] = defaultdict(list)
    for reading in readings:
        groups[reading.station].append(reading)
    for items in groups.values():
        items.sort(key=lambda r: r.timestamp)
    return dict(groups)


def median_moisture(readings: list[Reading]) -> float:
    """Median raw moisture, ignoring invalid samples."""
    values = [r.moisture_raw for r in readings if is_valid(r)]
    if not values:
        raise ValueError("no valid readings")
    return float(statistics.median(values))


def watering_minutes(raw: int, temperature_c: float) -> int:
    """How long the drip line at a station should run tonight."""
    level = classify_moisture(raw)
    base = {"parched": 40, "dry": 25, "moist": 10, "wet": 0, "waterlogged": 0}[level]
    if temperature_c >= 28:
        base += 15
    elif temperature_c >= 22:
        base += 5
    return base


def missing_samples(readings: list[Reading], interval_s: int = DEFAULT_SAMPLE_INTERVAL_S) -> int:
    """Count samples that should have arrived between the first and last one."""
    if len(readings) < 2:
        return 0
    span = readings[-1].timestamp - readings[0].timestamp
    expected = span // interval_s + 1
    return max(0, expected - len(readings))


def daily_summary(readings: Iterable[Reading]) -> dict[str, dict[str, object]]:
    """Per-station summary used in the evening email."""
    summary: dict[str, dict[str, object]] = {}
    for station, items in group_by_station(readings).items():
        valid = [r for r in items if is_valid(r)]
        if not valid:
            summary[station] = {"name": STATION_NAMES.get(station, station), "status": "no data"}
            continue
        last = valid[-1]
        summary[station] = {
            "name": STATION_NAMES.get(station, station),
            "moisture": classify_moisture(last.moisture_raw),
            "moisture_percent": moisture_percent(last.moisture_raw),
            "min_temperature_c": min(r.temperature_c for r in valid),
            "battery": battery_status(last.battery_v),
            "water_minutes": watering_minutes(last.moisture_raw, last.temperature_c),
            "missing": missing_samples(items),
        }
    return summary


def stations_needing_attention(summary: dict[str, dict[str, object]]) -> list[str]:
    """Stations whose battery needs replacing or whose soil is parched."""
    out = []
    for station, info in sorted(summary.items()):
        if info.get("battery") == "replace" or info.get("moisture") == "parched":
            out.append(station)
    return out


def parse_line(line: str) -> Reading:
    """Parse one CSV line: station,timestamp,moisture,temperature,battery."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 5:
        raise ValueError(f"expected 5 fields, got {len(parts)}")
    station, ts, raw, temp, volts = parts
    return Reading(station, int(ts), int(raw), float(temp), float(volts))


def parse_log(text: str) -> list[Reading]:
    """Parse a whole log, skipping comments and blank lines."""
    readings = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        readings.append(parse_line(line))
    return readings


def format_summary(summary: dict[str, dict[str, object]]) -> str:
    """Plain-text version of the daily summary."""
    lines = []
    for station, info in sorted(summary.items()):
        if info.get("status") == "no data":
            lines.append(f"{station} ({info['name']}): no data")
            continue
        lines.append(
            f"{station} ({info['name']}): {info['moisture']} ({info['moisture_percent']}%), "
            f"min {info['min_temperature_c']} C, battery {info['battery']}, "
            f"water {info['water_minutes']} min"
        )
    return "\n".join(lines)
