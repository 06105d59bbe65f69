"""Summaries of a sweep: per-level statistics, the terminal table, JSON/CSV files, the per-request
timeline and the plot."""

from __future__ import annotations

import csv
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

from neuron_lmi.bench.runner import LevelRun

COLUMNS = (
    ("concurrency", "conc", "{:d}"),
    ("requests", "reqs", "{:d}"),
    ("success_pct", "ok %", "{:.1f}"),
    ("requests_per_s", "req/s", "{:.2f}"),
    ("output_tokens_per_s", "out tok/s", "{:.1f}"),
    ("ttft_p50_ms", "TTFT p50", "{:.1f}"),
    ("ttft_p90_ms", "TTFT p90", "{:.1f}"),
    ("ttft_p99_ms", "TTFT p99", "{:.1f}"),
    ("itl_p50_ms", "ITL p50", "{:.2f}"),
    ("itl_p99_ms", "ITL p99", "{:.2f}"),
    ("e2e_p50_ms", "E2E p50", "{:.1f}"),
    ("e2e_p90_ms", "E2E p90", "{:.1f}"),
)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation between order statistics; None if empty."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000.0


def summarize(run: LevelRun) -> dict[str, Any]:
    """Statistics of one level. Latency percentiles cover successful requests only."""
    ok = [r for r in run.results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [gap for r in ok for gap in r.itl]
    e2es = [r.e2e for r in ok]
    output_tokens = sum(r.output_tokens for r in ok)
    wall = max(run.wall_s, 1e-9)
    n = len(run.results)
    return {
        "concurrency": run.concurrency,
        "requests": n,
        "successes": len(ok),
        "errors": n - len(ok),
        "success_pct": 100.0 * len(ok) / n if n else 0.0,
        "errors_by_kind": dict(Counter(r.error for r in run.results if not r.ok and r.error)),
        # What the first failures said (distinct, at most 5): a run's record of why, not only how many.
        "error_details": list(dict.fromkeys(r.detail for r in run.results if not r.ok and r.detail))[:5],
        "duration_s": run.wall_s,
        "requests_per_s": len(ok) / wall,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / wall,
        "prompt_tokens_per_s": sum(r.prompt_tokens for r in ok) / wall,
        "ttft_p50_ms": _ms(percentile(ttfts, 50)),
        "ttft_p90_ms": _ms(percentile(ttfts, 90)),
        "ttft_p99_ms": _ms(percentile(ttfts, 99)),
        "itl_p50_ms": _ms(percentile(itls, 50)),
        "itl_p99_ms": _ms(percentile(itls, 99)),
        "e2e_p50_ms": _ms(percentile(e2es, 50)),
        "e2e_p90_ms": _ms(percentile(e2es, 90)),
    }


def format_table(summaries: list[dict[str, Any]]) -> str:
    """A plain-text table, one row per concurrency level, then the errors of each level."""
    header = [title for _, title, _ in COLUMNS]
    rows = [["-" if s[key] is None else fmt.format(s[key]) for key, _, fmt in COLUMNS] for s in summaries]
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=False)]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("latencies in ms; TTFT and ITL need --stream")
    for s in summaries:
        if s["errors"]:
            kinds = ", ".join(f"{kind}: {count}" for kind, count in sorted(s["errors_by_kind"].items()))
            lines.append(f"concurrency {s['concurrency']}: {s['errors']} errors ({kinds})")
    return "\n".join(lines)


def write_results(path: Path, config: dict[str, Any], summaries: list[dict[str, Any]]) -> None:
    """Write ``.json`` (config + summaries) or ``.csv`` (one row per level), chosen by suffix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    suffix = path.suffix.lower()
    if suffix == ".json":
        path.write_text(json.dumps({"config": config, "levels": summaries}, indent=2) + "\n")
    elif suffix == ".csv":
        listed = ("errors_by_kind", "error_details")
        fields = [key for key in summaries[0] if key not in listed] + list(listed)
        with path.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=fields)
            writer.writeheader()
            for s in summaries:
                writer.writerow({**s, **{key: json.dumps(s[key], sort_keys=True) for key in listed}})
    else:
        raise ValueError(f"--out {path}: expected a .json or .csv file name")


def write_timeline(path: Path, runs: list[LevelRun]) -> None:
    """Every request's wall-clock send time and its token arrivals (seconds after sending), per level:
    what a latency taken over part of a run (the ITL while other requests arrive) is computed from."""
    path.parent.mkdir(parents=True, exist_ok=True)
    levels = [
        {
            "concurrency": run.concurrency,
            "requests": [
                {"index": r.index, "ok": r.ok, "sent_at": r.sent_at, "token_times": r.token_times}
                for r in run.results
            ],
        }
        for run in runs
    ]
    path.write_text(json.dumps({"levels": levels}) + "\n")


def plot(path: Path, summaries: list[dict[str, Any]], title: str) -> None:
    """Latency (left) and throughput (right) against concurrency, written with matplotlib's Agg."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    x = [s["concurrency"] for s in summaries]
    fig, (lat, thr) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, label in (
        ("ttft_p50_ms", "TTFT p50"),
        ("ttft_p99_ms", "TTFT p99"),
        ("e2e_p50_ms", "E2E p50"),
        ("e2e_p90_ms", "E2E p90"),
    ):
        points = [(c, s[key]) for c, s in zip(x, summaries, strict=True) if s[key] is not None]
        if points:
            lat.plot(*zip(*points, strict=True), marker="o", label=label)
    lat.set(xlabel="concurrency", ylabel="latency (ms)", title="latency")
    tok = [s["output_tokens_per_s"] for s in summaries]
    thr.plot(x, tok, marker="o", color="tab:green", label="output tokens/s")
    thr.set(xlabel="concurrency", ylabel="output tokens/s", title="throughput")
    req_axis = thr.twinx()
    req_axis.plot(x, [s["requests_per_s"] for s in summaries], marker="s", color="tab:purple")
    req_axis.set_ylabel("requests/s", color="tab:purple")
    for axis in (lat, thr):
        if len(set(x)) > 1 and max(x) / min(x) >= 8:
            axis.set_xscale("log", base=2)
        axis.grid(True, alpha=0.3)
    if lat.get_lines():
        lat.legend(fontsize="small")
    else:
        lat.text(0.5, 0.5, "no successful requests", ha="center", va="center", transform=lat.transAxes)
    thr.legend(fontsize="small", loc="upper left")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
