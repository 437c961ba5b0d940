#!/usr/bin/env python3
"""PNG plots of the load scenarios' JSON results, for docs/benchmarks.md.

Reads the results `gpumedic-load-tests` writes (default target/load-tests/) and writes:

- latency.png from latency.json: the fault-to-cordon latency distribution (ECDF), p50, p99 and
  max marked beside the 1 s goal, each fault's latency in send order, and the background rate.
- pipeline-throughput.png from pipeline-throughput.json: produced (acknowledged by Kafka) and
  classified events per second over time, beside the Kafka passthrough consume rate of the
  same run and the 50,000/s goal.
- soak.png from soak.json, only where it exists: RSS per service, consumer lag per service and
  classified events per second over the run.
- fleet-scale-memory.png from fleet-scale.json (and fleet-scale-*.json, runs at other sizes
  whose steps are merged by fleet size), where they exist: each service's and server's peak
  memory against the number of nodes, steady and during the burst, beside the 2 GB goal.

A result that is missing is skipped with a note; a result without the fields a plot needs (one
written before they existed) fails with a message saying which scenario to run again. Each plot
carries a subtitle with the machine and the date of the run, taken from the JSON file's mtime
(the scenarios do not record a date of their own).

Run it through load-tests/plot/run, which installs the pinned requirements in a virtualenv.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on the machines that run the benchmarks

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

# 10 inches at 100 dpi: 1000 px wide, the width the docs are read at, so the fonts below are
# the sizes a reader sees.
WIDTH_IN = 10.0
DPI = 100
GOAL_LATENCY_MS = 1000.0
GOAL_PIPELINE_PER_SEC = 50_000.0
GOAL_FLEET_SERVICES_MIB = 2048.0
# The soak's services in the pipeline's order (its JSON lists them alphabetically).
PIPELINE_ORDER = ["enricher", "classifier", "remediator"]

plt.rcParams.update(
    {
        "font.size": 11,
        "axes.titlesize": 12,
        "axes.labelsize": 11,
        "legend.fontsize": 10,
        "figure.titlesize": 14,
        "axes.grid": True,
        "grid.alpha": 0.3,
    }
)

THOUSANDS = FuncFormatter(lambda v, _: f"{v:,.0f}")


class StaleResult(Exception):
    """A result file without the fields a plot needs."""


def load(path: Path) -> dict | None:
    if not path.is_file():
        print(f"skipped: {path} not found")
        return None
    with path.open() as f:
        return json.load(f)


def need(result: dict, path: Path, *fields: str) -> None:
    missing = [f for f in fields if f not in result]
    if missing:
        raise StaleResult(
            f"{path} has no {', '.join(missing)}: run `target/release/gpumedic-load-tests "
            f"{result.get('scenario', path.stem)}` again with the current load tests"
        )


def subtitle(path: Path, machine: str, figures: str) -> str:
    """The machine, the date of the run (the result's mtime, UTC) and the run's own figures."""
    when = dt.datetime.fromtimestamp(path.stat().st_mtime, tz=dt.timezone.utc)
    return f"{machine} · run of {when:%Y-%m-%d %H:%M} UTC · {figures}"


def titled(fig: plt.Figure, title: str, sub: str) -> None:
    fig.suptitle(title, fontweight="bold", y=0.995)
    fig.text(0.5, 0.962, sub, ha="center", va="top", fontsize=10, color="0.3")


def save(fig: plt.Figure, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    # No software version in the PNG's metadata: the same JSON gives the same bytes.
    fig.savefig(out, dpi=DPI, metadata={"Software": None})
    plt.close(fig)
    print(f"wrote {out}")


def window_rate(t: np.ndarray, count: np.ndarray, width: float) -> np.ndarray:
    """Events per second at each sample, over a window of `width` seconds centred on it.

    The counts are interpolated at the window's ends, and a window is cut to the run at its
    first and last sample (and divided by what is left), so the edges are not biased to zero.
    """
    lo = np.clip(t - width / 2, t[0], t[-1])
    hi = np.clip(t + width / 2, t[0], t[-1])
    span = np.maximum(hi - lo, 1e-9)
    return (np.interp(hi, t, count) - np.interp(lo, t, count)) / span


def plot_latency(path: Path, out: Path, machine: str) -> bool:
    r = load(path)
    if r is None:
        return False
    need(r, path, "latencies_ms", "background_timeline")
    by_fault = np.array([np.nan if v is None else v for v in r["latencies_ms"]], dtype=float)
    seen = np.sort(by_fault[~np.isnan(by_fault)])
    if seen.size == 0:
        raise StaleResult(f"{path}: no fault reached a cordon, nothing to plot")

    fig, (ecdf, order, bg) = plt.subplots(
        3, 1, figsize=(WIDTH_IN, 11), gridspec_kw={"height_ratios": [3, 2, 1.4]}
    )
    titled(
        fig,
        f"Fault to cordon: {r['cordoned']} of {r['faults']} Xid 79 faults, {r['nodes']} nodes, "
        f"background {r['background_rate_achieved']:,.0f} events/s",
        subtitle(
            path,
            machine,
            f"p50 {r['p50_ms']:.0f} ms, p99 {r['p99_ms']:.0f} ms, max {r['max_ms']:.0f} ms; "
            f"plain node patch p50 {r['floor_patch_p50_ms']:.1f} ms",
        ),
    )

    # The distribution, as an ECDF on a log axis: 100 points read better as steps than as a
    # histogram, and the tail sits a decade to the right of the median.
    share = np.arange(1, seen.size + 1) / seen.size
    ecdf.step(seen, share, where="post", color="C0", lw=2, label=f"fault to cordon ({seen.size} faults)")
    marks = [
        (r["p50_ms"], "p50", "C2"),
        (r["p99_ms"], "p99", "C1"),
        (r["max_ms"], "max", "C4"),
    ]
    for value, name, color in marks:
        ecdf.axvline(value, color=color, ls=":", lw=1.5, label=f"{name} {value:.0f} ms")
    ecdf.axvline(r["floor_patch_p50_ms"], color="0.5", ls="-.", lw=1.2,
                 label=f"plain node patch p50 {r['floor_patch_p50_ms']:.1f} ms")
    ecdf.axvline(GOAL_LATENCY_MS, color="C3", ls="--", lw=2, label="goal: p99 < 1 s")
    ecdf.set_xscale("log")
    ecdf.set_xlim(min(seen[0], r["floor_patch_p50_ms"]) / 1.5, max(seen[-1], GOAL_LATENCY_MS) * 1.5)
    ecdf.set_ylim(0, 1.02)
    ecdf.xaxis.set_major_formatter(THOUSANDS)
    ecdf.set_xlabel("latency, fault produced to node seen cordoned (ms, log scale)")
    ecdf.set_ylabel("share of faults at or below")
    ecdf.set_title("Latency distribution (ECDF)")
    ecdf.legend(loc="lower right")

    # Each fault in the order sent: shows whether the tail is the warm-up or spread over the run.
    n = np.arange(1, by_fault.size + 1)
    order.plot(n, by_fault, "o", ms=4, color="C0", label="fault to cordon")
    # Faults never seen cordoned are drawn above the goal line, where a latency would have to be.
    missed = np.isnan(by_fault)
    ceiling = max(GOAL_LATENCY_MS, seen[-1]) * 2
    if missed.any():
        order.plot(n[missed], np.full(missed.sum(), ceiling), "x", ms=7, color="C3",
                   label=f"never seen cordoned ({missed.sum()})")
    order.axhline(GOAL_LATENCY_MS, color="C3", ls="--", lw=2, label="goal 1 s")
    order.set_yscale("log")
    order.set_ylim(seen[0] / 1.5, ceiling * 8)
    order.yaxis.set_major_formatter(THOUSANDS)
    order.set_xlabel("fault, in the order sent (one every fault interval, after a 5 s warm-up)")
    order.set_ylabel("latency (ms, log)")
    order.set_title("Each fault's latency")
    order.legend(loc="upper center", ncols=3)

    timeline = np.array(r["background_timeline"], dtype=float)
    if len(timeline) >= 2:
        t, sent = timeline[:, 0], timeline[:, 1]
        rate = np.diff(sent) / np.maximum(np.diff(t), 1e-9)
        bg.step(t[1:], rate, where="pre", color="C5", lw=1.5, label="achieved (each second)")
    bg.axhline(r["background_rate_target"], color="0.4", ls="--", lw=1.2,
               label=f"target {r['background_rate_target']:,}/s")
    bg.set_ylim(0, r["background_rate_target"] * 1.3)
    bg.yaxis.set_major_formatter(THOUSANDS)
    bg.set_xlabel("time since the background producer started (s)")
    bg.set_ylabel("events/s")
    bg.set_title("Background telemetry rate")
    bg.legend(loc="lower right", ncols=2)

    fig.tight_layout(rect=(0, 0, 1, 0.955))
    save(fig, out)
    return True


def plot_pipeline(path: Path, out: Path, machine: str, window: float) -> bool:
    r = load(path)
    if r is None:
        return False
    need(r, path, "timeline")
    timeline = np.array(r["timeline"], dtype=float)
    if len(timeline) < 2:
        raise StaleResult(f"{path}: fewer than two timeline samples, nothing to plot")
    t, produced, classified = timeline[:, 0], timeline[:, 1], timeline[:, 2]

    fig, (rates, totals) = plt.subplots(
        2, 1, figsize=(WIDTH_IN, 9), sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    titled(
        fig,
        f"Pipeline throughput: {r['events']:,} raw events through enricher + classifier, persisted",
        subtitle(
            path,
            machine,
            f"{r['pipeline_per_sec']:,.0f} events/s over {r['pipeline_seconds']:.1f} s; "
            f"Kafka passthrough produce {r['kafka_produce_per_sec']:,.0f}/s, "
            f"consume {r['kafka_consume_per_sec']:,.0f}/s",
        ),
    )

    # Log scale: the passthrough line sits an order of magnitude above the pipeline's rate.
    floor = 1_000.0
    for series, name, color in [(produced, "produced (acknowledged by Kafka)", "C0"),
                                (classified, "classified and persisted", "C2")]:
        rate = window_rate(t, series, window)
        rates.plot(t, np.where(rate >= floor, rate, np.nan), color=color, lw=2, label=name)
    rates.axhline(r["kafka_consume_per_sec"], color="C7", ls="-.", lw=1.5,
                  label=f"Kafka passthrough consume {r['kafka_consume_per_sec']:,.0f}/s")
    rates.axhline(GOAL_PIPELINE_PER_SEC, color="C3", ls="--", lw=2, label="goal 50,000/s")
    rates.axhline(r["pipeline_per_sec"], color="C2", ls=":", lw=1.5,
                  label=f"pipeline mean {r['pipeline_per_sec']:,.0f}/s")
    rates.set_yscale("log")
    top = max(r["kafka_consume_per_sec"], r["kafka_produce_per_sec"], np.nanmax(window_rate(t, produced, window)))
    rates.set_ylim(floor, top * 2)
    rates.yaxis.set_major_formatter(THOUSANDS)
    rates.set_ylabel(f"events/s ({window:g} s windows, log)")
    rates.set_title("Rate over time")
    # Below the passthrough line, right of the produce burst: the space the curves leave empty.
    rates.legend(loc="upper right", bbox_to_anchor=(1, 0.9), ncols=2)

    totals.plot(t, produced, color="C0", lw=2, label="produced (acknowledged by Kafka)")
    totals.plot(t, classified, color="C2", lw=2, label="classified and persisted")
    totals.axhline(r["events"], color="0.5", ls=":", lw=1)
    totals.yaxis.set_major_formatter(THOUSANDS)
    totals.set_xlabel("time since the first produce (s)")
    totals.set_ylabel("events, total")
    totals.set_title("Cumulative events (the gap is the pipeline's backlog)")
    totals.legend(loc="lower right")

    fig.tight_layout(rect=(0, 0, 1, 0.955))
    save(fig, out)
    return True


def plot_soak(path: Path, out: Path, machine: str) -> bool:
    r = load(path)
    if r is None:
        return False
    need(r, path, "samples")
    samples = r["samples"]
    if len(samples) < 2:
        raise StaleResult(f"{path}: fewer than two samples, nothing to plot")
    t = np.array([s["t_s"] for s in samples], dtype=float)
    minutes = t[-1] > 600
    x = t / 60 if minutes else t
    unit = "min" if minutes else "s"
    # In the pipeline's order, then any other in the order listed; one colour per service in every
    # panel.
    listed = dict.fromkeys(name for s in samples for f in ("rss_mib", "lag") for name in s.get(f, {}))
    services = [n for n in PIPELINE_ORDER if n in listed] + [n for n in listed if n not in PIPELINE_ORDER]
    # The scenario's own verdict per service, where it gives one, goes in the legend.
    verdicts = {v["service"]: v for v in r.get("verdicts", []) if "service" in v}

    def label(name: str, flat_field: str) -> str:
        flat = verdicts.get(name, {}).get(flat_field)
        return name if flat is None else f"{name} ({'flat' if flat else 'GROWING'})"

    def series(field: str, service: str) -> np.ndarray:
        return np.array([s.get(field, {}).get(service, np.nan) for s in samples], dtype=float)

    fig, (rss, lag, rate) = plt.subplots(3, 1, figsize=(WIDTH_IN, 11), sharex=True)
    duration = r.get("duration_s", t[-1])
    target = r.get("rate")
    span = f"{duration / 60:.0f} min" if duration >= 600 else f"{duration:.0f} s"
    head = f"Soak: {target:,} events/s for {span}" if target else "Soak"
    classified = np.array([s.get("classified", np.nan) for s in samples], dtype=float)
    produced = np.array([s.get("produced", np.nan) for s in samples], dtype=float)
    mean = (classified[-1] - classified[0]) / max(t[-1] - t[0], 1e-9)
    titled(fig, head, subtitle(path, machine, f"{len(samples)} samples, classified {mean:,.0f} events/s on average"))

    for i, name in enumerate(services):
        rss.plot(x, series("rss_mib", name), color=f"C{i}", lw=1.8, label=label(name, "rss_flat"))
        lag.plot(x, series("lag", name), color=f"C{i}", lw=1.8, label=label(name, "lag_flat"))
    rss.set_ylabel("RSS (MiB)")
    rss.set_ylim(0, np.nanmax([series("rss_mib", s) for s in services]) * 1.3)
    rss.set_title("Resident memory per service")
    rss.legend(loc="upper left", ncols=len(services))
    lag.set_ylabel("lag (records)")
    lag.set_ylim(0, max(np.nanmax([series("lag", s) for s in services]), 1) * 1.3)
    lag.yaxis.set_major_formatter(THOUSANDS)
    lag.set_title("Consumer lag per service")
    lag.legend(loc="upper left", ncols=len(services))

    # Between consecutive samples: the samples are seconds apart already, so no wider window.
    dt_s = np.maximum(np.diff(t), 1e-9)
    classified_rate = np.diff(classified) / dt_s
    rate.step(x[1:], classified_rate, where="pre", color="C2", lw=1.8, label="classified")
    if not np.isnan(produced).all():
        rate.step(x[1:], np.diff(produced) / dt_s, where="pre", color="C0", lw=1, alpha=0.7, label="produced")
    if target:
        rate.axhline(target, color="0.4", ls="--", lw=1.2, label=f"target {target:,}/s")
    rate.set_ylim(0, max(np.nanmax(classified_rate), target or 0, 1) * 1.3)
    rate.yaxis.set_major_formatter(THOUSANDS)
    rate.set_ylabel("events/s")
    rate.set_xlabel(f"time since the soak started ({unit})")
    rate.set_title("Events per second, between samples")
    rate.legend(loc="lower right", ncols=3)

    fig.tight_layout(rect=(0, 0, 1, 0.955))
    save(fig, out)
    return True


def plot_fleet_scale(results: Path, out: Path, machine: str) -> bool:
    paths = sorted(results.glob("fleet-scale*.json"))
    steps: dict[int, dict] = {}
    for path in paths:
        r = load(path)
        if r is None:
            continue
        need(r, path, "steps")
        for step in r["steps"]:
            need(step, path, "nodes", "steady", "burst")
            steps[int(step["nodes"])] = step
    if len(steps) < 2:
        if paths:
            print(f"skip: fleet-scale memory needs two fleet sizes or more, {len(steps)} found", file=sys.stderr)
        return False
    nodes = np.array(sorted(steps), dtype=float)
    ordered = [steps[int(n)] for n in nodes]

    def peak(phase: str, name: str) -> np.ndarray:
        return np.array([s[phase].get("peak_mib", {}).get(name, np.nan) for s in ordered], dtype=float)

    fig, (ours, servers) = plt.subplots(1, 2, figsize=(WIDTH_IN, 5.2))
    sizes = ", ".join(f"{int(n):,}" for n in nodes)
    together = peak("burst", "enricher") + peak("burst", "classifier") + peak("burst", "remediator")
    titled(fig, "Memory against fleet size",
           subtitle(paths[-1], machine, f"nodes {sizes}; gpumedic's services at the burst's peak: "
                    + ", ".join(f"{v:,.0f}" for v in together) + " MiB"))
    ours.plot(nodes, together, "o-", color="k", lw=2, label="three services, burst peak")
    for i, name in enumerate(PIPELINE_ORDER):
        ours.plot(nodes, peak("burst", name), "o-", color=f"C{i}", lw=1.6, label=f"{name}, burst")
        ours.plot(nodes, peak("steady", name), "o--", color=f"C{i}", lw=1.2, alpha=0.7, label=f"{name}, steady")
    ours.axhline(GOAL_FLEET_SERVICES_MIB, color="C3", ls=":", lw=1.5, label="goal: 2 GB for all three")
    ours.set_title("gpumedic's services (peak RSS)")
    ours.set_ylabel("MiB")
    ours.set_ylim(0, max(np.nanmax(together), GOAL_FLEET_SERVICES_MIB) * 1.15)
    ours.legend(loc="upper left", fontsize=8)
    for i, name in enumerate(["kube-apiserver", "etcd", "kafka", "postgres"]):
        servers.plot(nodes, peak("burst", name), "o-", color=f"C{i + 4}", lw=1.6, label=name)
    servers.set_title("The servers underneath (peak during the burst)")
    servers.set_ylabel("MiB")
    servers.legend(loc="upper left")
    for ax in (ours, servers):
        ax.set_xlabel("GPU nodes (8 GPUs each)")
        ax.xaxis.set_major_formatter(THOUSANDS)
        ax.yaxis.set_major_formatter(THOUSANDS)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    save(fig, out)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path,
                        default=Path(os.environ.get("GPUMEDIC_PLOT_RESULTS", "target/load-tests")),
                        help="folder of the scenarios' JSON results (default target/load-tests)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("GPUMEDIC_PLOT_OUT", "docs/img")),
                        help="folder the PNGs go to (default docs/img)")
    parser.add_argument("--machine", default=os.environ.get("GPUMEDIC_PLOT_MACHINE"),
                        help="the machine, for the subtitle (default: this machine's core count; "
                             "set it when plotting results from elsewhere)")
    # Half a second: the whole produce burst lasts about a second, and the classifier's count moves
    # in batches of up to 5,000, which a shorter window shows as steps rather than a rate.
    parser.add_argument("--window", type=float, default=0.5,
                        help="seconds per rate window in the pipeline plot (default 0.5)")
    args = parser.parse_args()
    machine = args.machine or f"{os.cpu_count()} cores"

    try:
        wrote = [
            plot_latency(args.results / "latency.json", args.out / "latency.png", machine),
            plot_pipeline(args.results / "pipeline-throughput.json", args.out / "pipeline-throughput.png",
                          machine, args.window),
            plot_soak(args.results / "soak.json", args.out / "soak.png", machine),
            plot_fleet_scale(args.results, args.out / "fleet-scale-memory.png", machine),
        ]
    except StaleResult as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not any(wrote):
        print(f"error: no results in {args.results}; run the load scenarios first", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
