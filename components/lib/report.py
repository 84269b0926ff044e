"""Run files → numbers and a self-contained HTML report (inline SVG, no scripts, no external resources).

Reads the trainer's ``metrics.jsonl`` and the recovery ledger ``recovery.jsonl`` defensively: a torn last
line (a process killed mid-write) or an unknown record is skipped and counted, never fatal, because the
report is written after faults by design. Every piece of text from those files is HTML-escaped.
"""

from __future__ import annotations

import base64
import html
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

LAYERS = ("inprocess", "injob", "node", "cluster")
LAYER_TITLES = {"inprocess": "in-process", "injob": "in-job (ft_launcher)", "node": "node (replaced or spare)",
                "cluster": "cluster / pipeline retry"}
LAYER_COLOURS = {"inprocess": "#1f77b4", "injob": "#ff7f0e", "node": "#9467bd", "cluster": "#d62728"}


def read_jsonl(path: str | Path) -> tuple[list[dict[str, Any]], int]:
    """The JSON objects of a JSON-lines file and the number of unreadable lines; ([], 0) if it is missing."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return [], 0
    records, bad = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(value, dict):
            records.append(value)
        else:
            bad += 1
    return records, bad


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _events(ledger: Iterable[Mapping[str, Any]], event: str) -> list[Mapping[str, Any]]:
    """Records of one event kind that name a known layer (the ledger schema: ``trainer/ledger.py``)."""
    return [r for r in ledger if r.get("event") == event and r.get("layer") in LAYERS]


def _restarts(ledger: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """One ``restart`` record per recovery: every rank writes one, rank 0's stands for the group."""
    return [r for r in _events(ledger, "restart") if r.get("rank", 0) == 0]


def _elastic(ledger: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Rank 0's ``elastic`` records (one per change of world size) with a readable time and new size, oldest first."""
    changes = [r for r in ledger if r.get("event") == "elastic" and r.get("rank", 0) == 0
               and _num(r.get("time")) is not None and _num(r.get("after")) is not None]
    return sorted(changes, key=lambda r: _num(r["time"]) or 0.0)


def summarize_ledger(ledger: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Faults, restarts per layer, steps redone, recovery time, size changes and goodput from the recovery ledger.

    Restarts are counted from rank 0's ``restart`` records (one per recovery); steps redone and
    recovery time from the ``recovered`` records; ``size_changes`` from rank 0's ``elastic`` records (restarts on
    another world size); goodput from the newest ``summary`` record.
    """
    restarts = _restarts(ledger)
    recovered = _events(ledger, "recovered")
    summary = next((r for r in reversed(ledger) if r.get("event") == "summary"), {})
    return {
        "faults": sum(1 for r in ledger if r.get("event") == "fault"),
        "restarts": {layer: sum(1 for r in restarts if r["layer"] == layer) for layer in LAYERS},
        "steps_redone": int(sum(_num(r.get("steps_redone")) or 0 for r in recovered)),
        "recovery_s": {layer: round(sum(_num(r.get("recovery_s")) or 0 for r in recovered if r["layer"] == layer), 3)
                       for layer in LAYERS},
        "size_changes": len(_elastic(ledger)),
        "goodput": _num(summary.get("goodput")),
        "productive_s": _num(summary.get("productive_s")),
        "wall_s": _num(summary.get("wall_s")),
    }


def loss_points(metrics: Iterable[Mapping[str, Any]]) -> list[tuple[float, float]]:
    """(step, loss) of the step records; a step redone after a restart keeps its latest loss."""
    by_step: dict[float, float] = {}
    for r in metrics:
        if r.get("event") == "step":
            step, loss = _num(r.get("step")), _num(r.get("loss"))
            if step is not None and loss is not None:
                by_step[step] = loss
    return sorted(by_step.items())


# --- SVG ------------------------------------------------------------------------------------------------
W, H, PAD_L, PAD_R, PAD_T, PAD_B = 720, 260, 60, 20, 20, 40


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def _fmt(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 100 or float(v).is_integer() else f"{v:.3g}"


def _axes(x_lo: float, x_hi: float, y_lo: float, y_hi: float, x_label: str, y_label: str) -> tuple[list[str], Any]:
    def sx(x: float) -> float:
        return PAD_L + (x - x_lo) / ((x_hi - x_lo) or 1) * (W - PAD_L - PAD_R)

    def sy(y: float) -> float:
        return H - PAD_B - (y - y_lo) / ((y_hi - y_lo) or 1) * (H - PAD_T - PAD_B)

    parts = [f'<rect x="{PAD_L}" y="{PAD_T}" width="{W - PAD_L - PAD_R}" height="{H - PAD_T - PAD_B}" '
             'fill="none" stroke="#999"/>']
    for t in _ticks(x_lo, x_hi):
        parts.append(f'<text x="{sx(t):.1f}" y="{H - PAD_B + 16}" text-anchor="middle" font-size="11">{_fmt(t)}</text>')
    for t in _ticks(y_lo, y_hi):
        parts.append(f'<line x1="{PAD_L}" x2="{W - PAD_R}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" stroke="#eee"/>')
        parts.append(f'<text x="{PAD_L - 6}" y="{sy(t) + 4:.1f}" text-anchor="end" font-size="11">{_fmt(t)}</text>')
    parts.append(f'<text x="{(PAD_L + W - PAD_R) / 2}" y="{H - 6}" text-anchor="middle" font-size="12">'
                 f'{html.escape(x_label)}</text>')
    parts.append(f'<text x="14" y="{(PAD_T + H - PAD_B) / 2}" text-anchor="middle" font-size="12" '
                 f'transform="rotate(-90 14 {(PAD_T + H - PAD_B) / 2})">{html.escape(y_label)}</text>')
    return parts, (sx, sy)


def loss_chart(points: Sequence[tuple[float, float]], markers: Sequence[tuple[float, str, str]] = ()) -> str:
    """SVG line chart of loss by step; ``markers`` are (step, layer, label) vertical lines."""
    if not points:
        return '<p class="empty">No step metrics were recorded.</p>'
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x_lo, x_hi = min(xs), max(max(xs), *(m[0] for m in markers)) if markers else max(xs)
    y_lo, y_hi = min(ys), max(ys)
    pad = (y_hi - y_lo) * 0.05 or 0.5
    parts, (sx, sy) = _axes(x_lo, x_hi, y_lo - pad, y_hi + pad, "step", "training loss")
    for step, layer, label in markers:
        colour = LAYER_COLOURS.get(layer, "#666")
        parts.append(f'<line x1="{sx(step):.1f}" x2="{sx(step):.1f}" y1="{PAD_T}" y2="{H - PAD_B}" stroke="{colour}" '
                     f'stroke-dasharray="4 3"><title>{html.escape(label)}</title></line>')
    path = " ".join(f"{'M' if i == 0 else 'L'}{sx(x):.1f},{sy(y):.1f}" for i, (x, y) in enumerate(points))
    parts.append(f'<path d="{path}" fill="none" stroke="#2a6" stroke-width="1.8"/>')
    return _svg("Training loss by step", parts)


def recovery_spans(ledger: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One span per recovery: layer, start (the fault, else the restart), end (first productive step)."""
    spans, changes = [], _elastic(ledger)
    for r in _events(ledger, "recovered"):
        end, took = _num(r.get("time")), _num(r.get("recovery_s"))
        if end is not None:
            resized = _resized(changes, r["layer"], end - (took or 0.0), end)
            spans.append({"layer": r["layer"], "start": end - (took or 0.0), "end": end,
                          "label": f"{r.get('fault_kind') or 'fault'} at step {r.get('fault_step')}: "
                                   f"{LAYER_TITLES[r['layer']]} recovery, first productive step {r.get('step')} "
                                   f"after {took or 0:.1f} s, {r.get('steps_redone')} step(s) redone"
                                   f"{_tiers(r.get('tiers'))}{resized}"})
    done = {(s["layer"], round(s["end"], 3)) for s in spans}
    for r in _restarts(ledger):  # a restart whose first step never completed
        t = _num(r.get("time"))
        if t is not None and not any(layer == r["layer"] and end >= t for layer, end in done):
            spans.append({"layer": r["layer"], "start": t, "end": t,
                          "label": f"{LAYER_TITLES[r['layer']]} restart at step {r.get('resumed_step')} "
                                   f"(no productive step followed){_resized(changes, r['layer'], t, t + 1.0)}"})
    return sorted(spans, key=lambda s: s["start"])


def _resized(changes: Sequence[Mapping[str, Any]], layer: str, start: float, end: float) -> str:
    """``; world size 2 -> 1 ranks``: the change of size a recovery of this layer between start and end came with."""
    return "".join(f"; world size {_fmt_n(c.get('before'))} -> {_fmt_n(c.get('after'))} ranks" for c in changes
                   if c.get("layer") == layer and start <= (_num(c.get("time")) or 0.0) <= end)


def _fmt_n(v: Any) -> str:
    """A number as the report prints it, anything else as ``?``."""
    return "?" if (n := _num(v)) is None else _fmt(n)


def _tiers(tiers: Any) -> str:
    """``; state from node-local (ranks 0, 1), disk (ranks 2, 3)``: where the ranks resumed from, when recorded."""
    if not isinstance(tiers, Mapping) or not tiers:
        return ""
    parts = [f"{'nothing: started over' if tier in ('none', 'None') else tier} (ranks {', '.join(map(str, ranks))})"
             for tier, ranks in sorted(tiers.items()) if isinstance(ranks, list)]  # 'None': ledgers before 'none'
    return "; state from " + ", ".join(parts) if parts else ""


def timeline_chart(spans: Sequence[Mapping[str, Any]], t0: float | None, t_end: float | None) -> str:
    """SVG swimlanes (one per layer): each recovery a bar from the fault to the first productive step."""
    if not spans:
        return '<p class="empty">No recoveries were recorded.</p>'
    start = min([s["start"] for s in spans] + ([t0] if t0 is not None else []))
    end = max([s["end"] for s in spans] + ([t_end] if t_end is not None else []))
    lane_h = (H - PAD_T - PAD_B) / len(LAYERS)
    left = PAD_L + 90

    def sx(x: float) -> float:
        return left + (x - start) / ((end - start) or 1) * (W - left - PAD_R)

    parts = []
    for i, layer in enumerate(LAYERS):
        y = PAD_T + i * lane_h
        parts.append(f'<rect x="{left}" y="{y:.1f}" width="{W - left - PAD_R}" height="{lane_h - 4:.1f}" '
                     'fill="#f6f6f6"/>')
        parts.append(f'<text x="{left - 6}" y="{y + lane_h / 2 + 4:.1f}" text-anchor="end" font-size="11">'
                     f'{html.escape(LAYER_TITLES[layer])}</text>')
    for s in spans:
        y = PAD_T + LAYERS.index(s["layer"]) * lane_h + 4
        width = max(3.0, sx(s["end"]) - sx(s["start"]))
        parts.append(f'<rect x="{sx(s["start"]):.1f}" y="{y:.1f}" width="{width:.1f}" height="{lane_h - 12:.1f}" '
                     f'fill="{LAYER_COLOURS[s["layer"]]}"><title>{html.escape(s["label"])}</title></rect>')
    for t in _ticks(0, end - start):
        parts.append(f'<text x="{sx(start + t):.1f}" y="{H - PAD_B + 16}" text-anchor="middle" font-size="11">'
                     f'{_fmt(t)}</text>')
    parts.append(f'<text x="{(left + W) / 2}" y="{H - 6}" text-anchor="middle" font-size="12">seconds since the '
                 'run started (bar: from the fault to the first productive step)</text>')
    return _svg("Recoveries by layer over time", parts)


def size_periods(metrics: Sequence[Mapping[str, Any]], ledger: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One period per world size in force, from rank 0's ``elastic`` records ([] when the size never changed).

    The first runs from the first ``start`` (else the oldest record) to the first change, each later one from its
    change to the next, the last to the newest record. Per period: ``ranks``; ``start``/``end`` (Unix seconds);
    ``from_step`` (the step it resumed from; 0 after a fresh start); ``to_step`` (the step the next change resumed
    from, else the newest step logged); ``steps`` (the newest step logged in it minus ``from_step``: steps later
    redone count, as they cost the time); ``tokens_per_s`` (the mean of its step records: the throughput at that
    size); ``accumulation`` (from the newest ``start``/``resume`` record of that size in ``metrics.jsonl``).
    A step record belongs to the period its time falls in; a missing field leaves its cell None, never an error.
    """
    changes = _elastic(ledger)
    if not changes:
        return []
    times = [t for r in [*metrics, *ledger] if (t := _num(r.get("time"))) is not None]
    starts = [r for r in [*ledger, *metrics] if r.get("event") == "start"]
    first = _num(changes[0]["time"]) or 0.0
    t0 = min([t for r in starts if (t := _num(r.get("time"))) is not None] or times)
    ranks0 = next((n for n in [_num(changes[0].get("before")), *(_num(r.get("world_size")) for r in starts)]
                   if n is not None), None)
    bounds = [(min(t0, first), ranks0, 0.0 if starts else None)]
    bounds += [(_num(c["time"]) or 0.0, _num(c["after"]), _num(c.get("step"))) for c in changes]
    t_end = max(times)
    steps = [(t, s, _num(r.get("tokens_per_s"))) for r in metrics if r.get("event") == "step"
             and (t := _num(r.get("time"))) is not None and (s := _num(r.get("step"))) is not None]
    sized = [(t, r) for r in metrics
             if r.get("event") in ("start", "resume") and (t := _num(r.get("time"))) is not None]
    periods = []
    for i, (start, ranks, from_step) in enumerate(bounds):
        last = i == len(bounds) - 1
        end = t_end if last else bounds[i + 1][0]
        mine = [(s, tps) for t, s, tps in steps if start <= t < end or (last and t == end)]
        newest = max((s for s, _ in mine), default=None)
        rates = [tps for _, tps in mine if tps is not None]
        prev = bounds[i - 1][0] if i else -math.inf  # a resume record is written just before its elastic record
        acc = [r.get("accumulation") for t, r in sized if prev <= t < end and _num(r.get("world_size")) == ranks]
        periods.append({"ranks": ranks, "start": start, "end": end, "from_step": from_step,
                        "to_step": newest if last else bounds[i + 1][2], "change": None if i == 0 else changes[i - 1],
                        "steps": None if newest is None or from_step is None else newest - from_step,
                        "tokens_per_s": sum(rates) / len(rates) if rates else None,
                        "accumulation": _num(acc[-1]) if acc else None})
    return periods


def size_chart(periods: Sequence[Mapping[str, Any]]) -> str:
    """SVG step function of the ranks in force over time; each change a dashed line (layer colour) titled with its
    step, sizes and cause."""
    known = [p for p in periods if p["ranks"] is not None]
    if not known:
        return '<p class="empty">No world size was recorded.</p>'
    t0 = periods[0]["start"]
    top = max(5.0, math.ceil(max(p["ranks"] for p in known) * 1.2))  # >= 5: whole-number ticks
    parts, (sx, sy) = _axes(0.0, max(p["end"] for p in periods) - t0, 0.0, top, "seconds since the run started",
                            "ranks (world size)")
    line: list[tuple[float, float]] = []
    for p in known:
        line += [(p["start"] - t0, p["ranks"]), (p["end"] - t0, p["ranks"])]
    parts.append(_polyline(line, sx, sy, "#2a6", "ranks in force"))
    for p in periods:
        if (c := p["change"]) is None:
            continue
        x = sx(p["start"] - t0)
        label = (f"step {_fmt_n(c.get('step'))}: {_fmt_n(c.get('before'))} -> {_fmt_n(c.get('after'))} ranks, "
                 f"cause {c.get('cause') or 'unknown'}, {LAYER_TITLES.get(str(c.get('layer')), 'unknown layer')}")
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{PAD_T}" y2="{H - PAD_B}" stroke-dasharray="4 3" '
                     f'stroke="{LAYER_COLOURS.get(str(c.get("layer")), "#666")}"><title>{html.escape(label)}</title>'
                     f'</line><text x="{x + 3:.1f}" y="{PAD_T + 12}" font-size="10">step '
                     f'{html.escape(_fmt_n(c.get("step")))}</text>')
    return _svg("World size over time", parts)


def size_html(periods: Sequence[Mapping[str, Any]]) -> str:
    """The chart and one table row per period at a size."""
    head = ("ranks", "from step", "to step", "duration (s)", "steps trained", "mean tokens/s", "accumulation",
            "changed by")
    rows = []
    for p in periods:
        c = p["change"] or {}
        cells = [_fmt_n(p["ranks"]), _fmt_n(p["from_step"]), _fmt_n(p["to_step"]), f"{p['end'] - p['start']:.1f}",
                 _fmt_n(p["steps"]), _fmt_n(p["tokens_per_s"]),
                 _fmt_n(p["accumulation"]), f"{c.get('cause') or 'unknown'} ({c.get('layer')})" if c else "start"]
        rows.append("<tr>" + "".join(f"<td>{html.escape(x)}</td>" for x in cells) + "</tr>")
    return (size_chart(periods) + '<p class="legend">dashed: a restart on another world size (colour: its layer); '
            "steps trained include those later redone; tokens/s: the mean of the period's logged steps.</p>"
            + "<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>" + "".join(rows) + "</table>")


STRAGGLER_COLOUR, RANK_COLOURS = "#d62728", ("#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf")
MAX_RANK_LINES = 8


def straggler_series(metrics: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """From the trainer's ``straggler`` records (``trainer/resiliency/straggler.py``): per rank its step time at each
    report, the reports that named it (below the threshold) and its host. A report redone after a restart keeps its
    latest record."""
    by_step: dict[float, Mapping[str, Any]] = {}
    for r in metrics:
        if r.get("event") == "straggler" and (step := _num(r.get("step"))) is not None:
            by_step[step] = r
    times: dict[int, list[tuple[float, float]]] = {}
    flagged: dict[int, list[tuple[float, float]]] = {}
    hosts: dict[int, str] = {}
    for step, r in sorted(by_step.items()):
        named = {x for x in r.get("stragglers", []) if isinstance(x, int)}
        for rank_rec in r.get("ranks", []):
            rank, t = rank_rec.get("rank"), _num(rank_rec.get("step_time_s"))
            if not isinstance(rank, int) or t is None:
                continue
            times.setdefault(rank, []).append((step, t))
            hosts[rank] = str(rank_rec.get("host", "?"))
            if rank in named:
                flagged.setdefault(rank, []).append((step, t))
    last = by_step[max(by_step)] if by_step else {}
    return {"times": times, "flagged": flagged, "hosts": hosts, "last": last}


def straggler_chart(series: Mapping[str, Any], evictions: Sequence[Mapping[str, Any]] = ()) -> str:
    """SVG: each rank's step time (its timed sections) at every straggler report; points where a rank was named a
    straggler in red, an eviction as a red dashed line. Beyond ``MAX_RANK_LINES`` ranks, the named and slowest ranks
    get lines and the others one grey median line."""
    times, flagged, hosts = series["times"], series["flagged"], series["hosts"]
    if not times:
        return '<p class="empty">No straggler reports were recorded.</p>'
    worst = sorted(times, key=lambda k: (k not in flagged, -max(t for _, t in times[k])))
    shown = sorted(worst[:MAX_RANK_LINES])
    others = [k for k in times if k not in shown]
    xs = [s for pts in times.values() for s, _ in pts]
    xs += [s for e in evictions if (s := _num(e.get("step"))) is not None]
    ys = [t for pts in times.values() for _, t in pts]
    pad = (max(ys) - min(ys)) * 0.05 or max(ys) * 0.05 or 0.01
    parts, (sx, sy) = _axes(min(xs), max(xs), max(0.0, min(ys) - pad), max(ys) + pad, "step (straggler reports)",
                            "step time (s)")
    for e in evictions:
        if (s := _num(e.get("step"))) is not None:
            parts.append(f'<line x1="{sx(s):.1f}" x2="{sx(s):.1f}" y1="{PAD_T}" y2="{H - PAD_B}" '
                         f'stroke="{STRAGGLER_COLOUR}" stroke-dasharray="4 3"><title>{html.escape(_evicted(e))}'
                         '</title></line>')
    if others:
        steps = sorted({s for k in others for s, _ in times[k]})
        median = [(s, sorted(t for k in others for x, t in times[k] if x == s)) for s in steps]
        line = [(s, ts[len(ts) // 2]) for s, ts in median]
        parts.append(_polyline(line, sx, sy, "#bbb", f"median of the other {len(others)} ranks"))
    for i, rank in enumerate(shown):
        colour = STRAGGLER_COLOUR if rank in flagged else RANK_COLOURS[i % len(RANK_COLOURS)]
        parts.append(_polyline(times[rank], sx, sy, colour, f"rank {rank} ({hosts[rank]})"))
        for s, t in flagged.get(rank, []):
            parts.append(f'<circle cx="{sx(s):.1f}" cy="{sy(t):.1f}" r="4" fill="{STRAGGLER_COLOUR}"><title>'
                         f'{html.escape(f"step {_fmt(s)}: rank {rank} on {hosts[rank]} named a straggler")}'
                         '</title></circle>')
        s, t = times[rank][-1]
        parts.append(f'<text x="{min(sx(s) + 4, W - PAD_R - 40):.1f}" y="{sy(t) - 4:.1f}" font-size="11" '
                     f'fill="{colour}">rank {rank}</text>')
    return _svg("Step time per rank at each straggler report", parts)


def _polyline(points: Sequence[tuple[float, float]], sx: Any, sy: Any, colour: str, title: str) -> str:
    path = " ".join(f"{'M' if i == 0 else 'L'}{sx(x):.1f},{sy(y):.1f}" for i, (x, y) in enumerate(points))
    return (f'<path d="{path}" fill="none" stroke="{colour}" stroke-width="1.8"><title>{html.escape(title)}</title>'
            '</path>')


def _evicted(e: Mapping[str, Any]) -> str:
    return (f"step {e.get('step')}: rank {e.get('rank')} on {e.get('host')} evicted as a straggler after "
            f"{e.get('reports')} report(s) below {e.get('threshold')}")


def _svg(title: str, parts: list[str]) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" role="img" viewBox="0 0 {W} {H}" width="{W}" height="{H}">'
            f'<title>{html.escape(title)}</title>' + "".join(parts) + "</svg>")


# --- HTML -----------------------------------------------------------------------------------------------
def _table(rows: Iterable[tuple[Any, Any]]) -> str:
    body = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(_cell(v))}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v, sort_keys=True)
    return "" if v is None else str(v)


CSS = """body{font-family:system-ui,sans-serif;margin:24px;max-width:800px;color:#222}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:8px 0}th,td{border:1px solid #ddd;padding:3px 8px;text-align:left;
font-size:13px}th{background:#fafafa;font-weight:600}.empty{color:#777}.decision{font-size:15px;padding:8px;
background:#f4f8ff;border-left:4px solid #36c}.legend span{display:inline-block;margin-right:14px;font-size:12px}"""


PLAN_GOAL = 0.95
PLAN_LOSSES = (("recoveries", ("recovery_inprocess", "recovery_injob", "recovery_node", "recovery_cluster")),
               ("steps redone", ("redone",)), ("snapshots", ("snapshots",)), ("peer copies", ("peer_copies",)),
               ("persisted writes", ("persist",)), ("waiting for a node", ("waiting_for_node",)))


def planning_html(plan: Mapping[str, Any], png: bytes | None = None) -> str:
    """The goodput planner's projection (``components.lib.planning``): a table per configuration with the losses, the
    goodput per booked GPU (spares included) with its band and the distance from the goal, the recommended settings,
    every input with where it came from (measured by which ledger, or a default and the command that measures it),
    and the chart (an inline PNG)."""
    cluster, model = plan.get("cluster", {}), plan.get("failure_model", {})
    names = plan.get("configuration_names", {})
    head = "".join(f"<th>{html.escape(h)}</th>" for h in (
        "configuration", "goodput", "95 % interval", "per booked GPU", "band (rate, defaults)", "spares",
        *(n for n, _ in PLAN_LOSSES), f"vs goal {PLAN_GOAL:.2f}"))
    rows = []
    for key, r in (plan.get("configurations") or {}).items():
        goodput, losses = _num(r.get("goodput")) or 0.0, r.get("losses") or {}
        per_booked = _num(r.get("goodput_per_booked_gpu")) or 0.0
        ends = ((r.get("band") or {}).get("both") or {}).get("goodput_per_booked_gpu") or [0.0, 0.0]
        cells = [names.get(key, key), f"{goodput:.2%}", f"±{_num(r.get('ci95')) or 0:.2%}", f"{per_booked:.2%}",
                 f"{ends[0]:.2%} to {ends[1]:.2%}", str(r.get("spares")),
                 *(f"{sum(_num(losses.get(x)) or 0.0 for x in keys):.2%}" for _, keys in PLAN_LOSSES),
                 f"{100 * (per_booked - PLAN_GOAL):+.2f} points"]
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    out = [f"<p>Projected from this run's costs at {cluster.get('gpus', 0):,} GPUs "
           f"({cluster.get('spare_nodes', 0)} spare nodes, this run's; suggested: {plan.get('suggested_spares')}; "
           f"a replacement pod in {cluster.get('replacement_s', 0):.0f} s), "
           f"failure model {html.escape(str(model.get('name')))} (MTBF {model.get('mtbf_h')} h at this size; "
           f"{html.escape(str(model.get('source')))}). Losses are shares of wall time; per booked GPU counts the "
           "spares as booked and idle; the band spans the failure rate's 95 % Poisson interval and every unmeasured "
           "input x0.5 to x1.5.</p>",
           f"<table><tr>{head}</tr>{''.join(rows)}</table>"]
    rec = (plan.get("recommendation") or {})
    for which in ("current", "recommended"):
        s = rec.get(which)
        if s:
            out.append(f"<p>{which}: snapshot every {s.get('interval')} steps, persist every {s.get('persist_every')}, "
                       f"{s.get('spares')} spare nodes: goodput {s.get('goodput'):.2%} "
                       f"(per booked GPU {s.get('goodput_per_booked_gpu'):.2%})</p>")
    out.append(_planning_inputs(plan.get("inputs") or []))
    for note in (plan.get("costs") or {}).get("notes", []):
        out.append(f'<p class="empty">{html.escape(str(note))}</p>')
    if png:
        out.append(f'<img alt="goodput per booked GPU against the number of GPUs per configuration" width="900" '
                   f'src="data:image/png;base64,{base64.b64encode(png).decode()}">')
    return "".join(out)


def _planning_inputs(inputs: Sequence[Mapping[str, Any]]) -> str:
    """Which of the planner's inputs were measured (and by which ledger), given, or defaulted (with the command that
    would measure them)."""
    rows = []
    for row in inputs:
        value = _num(row.get("value"))
        cells = [str(row.get("input")), "derived" if value is None else f"{value:.4g} s", str(row.get("kind")),
                 str(row.get("from")) + (f"; measure it: {row['measure']}" if row.get("measure") else "")]
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in ("input", "value", "measured?", "from"))
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>" if rows else ""


def render_report(*, title: str, metrics: Sequence[Mapping[str, Any]], ledger: Sequence[Mapping[str, Any]],
                  evaluation: Mapping[str, Any] | None = None, decision: Mapping[str, Any] | None = None,
                  run_info: Mapping[str, Any] | None = None, notes: Sequence[str] = (),
                  planning: tuple[Mapping[str, Any], bytes | None] | None = None) -> str:
    """The whole report as one HTML document; ``planning``: the goodput planner's result and chart (PNG bytes)."""
    summary = summarize_ledger(ledger)
    spans = recovery_spans(ledger)
    times = [t for t in (_num(r.get("time")) for r in [*metrics, *ledger]) if t is not None]
    markers = [(s, r["layer"], f"{LAYER_TITLES[r['layer']]} restart: resumed after step {_fmt(s)}")
               for r in _restarts(ledger) if (s := _num(r.get("resumed_step"))) is not None]
    step_recs = [r for r in metrics if r.get("event") == "step"]
    last_summary = next((r for r in reversed(metrics) if r.get("event") == "summary"), {})
    legend = "".join(f'<span style="color:{LAYER_COLOURS[k]}">&#9632; {html.escape(LAYER_TITLES[k])}</span>'
                     for k in LAYERS)
    out = [f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
           f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>"]
    if decision:
        out.append(f'<p class="decision">{html.escape(str(decision.get("reason", "")))}</p>')
    if run_info:
        out.append(_table(run_info.items()))
    out.append("<h2>Evaluation</h2>")
    out.append(_table(evaluation.items()) if evaluation else '<p class="empty">No evaluation result.</p>')
    out.append("<h2>Training loss</h2>")
    out.append(loss_chart(loss_points(metrics), markers))
    out.append(f'<p class="legend">{legend} (dashed: where training resumed after a restart)</p>')
    out.append(_table([("steps logged", len(step_recs)),
                       *((k, last_summary[k]) for k in ("steps", "tokens", "final_loss", "wall_time_s")
                         if k in last_summary)]))
    out.append("<h2>Recovery timeline</h2>")
    out.append(timeline_chart(spans, min(times) if times else None, max(times) if times else None))
    out.append(f'<p class="legend">{legend}</p>')
    if spans:
        out.append("<ul>" + "".join(f"<li>{html.escape(s['label'])}</li>" for s in spans) + "</ul>")
    if any(r.get("event") == "elastic" for r in ledger):  # the run changed size: the size in force over time
        periods = size_periods(metrics, ledger)
        out.append("<h2>World size</h2>")
        out.append(size_html(periods) if periods else '<p class="empty">No readable change of world size.</p>')
    out.append("<h2>Stragglers</h2>")
    series = straggler_series(metrics)
    evictions = [r for r in ledger if r.get("event") == "straggler_evicted"]
    out.append(straggler_chart(series, evictions))
    if series["times"]:
        last = series["last"]
        out.append(f'<p class="legend">Each rank\'s time in the timed parts of its step (data, forward/backward, '
                   f'optimizer), median per report; <span style="color:{STRAGGLER_COLOUR}">red</span>: a rank named a '
                   f'straggler (relative score below {html.escape(str(last.get("threshold")))}, scored on '
                   f'{html.escape(str(last.get("basis")))}), dashed: an eviction.</p>')
        slowest = sorted((r for r in last.get("ranks", []) if _num(r.get("relative")) is not None),
                         key=lambda r: r["relative"])[:3]
        out.append(_table([(f"step {last.get('step')}: rank {r.get('rank')} ({r.get('host')})",
                            f"relative {r['relative']:.2f}, individual {r.get('individual')}, step "
                            f"{r.get('step_time_s')} s") for r in slowest]))
    for e in evictions:
        out.append(f'<p class="decision">{html.escape(_evicted(e))}</p>')
    out.append("<h2>Goodput</h2>")
    goodput = summary["goodput"]
    out.append(_table([
        ("goodput (productive / wall time)", "not recorded" if goodput is None else f"{goodput:.1%}"),
        ("productive time (s)", summary["productive_s"]),
        ("wall time (s)", summary["wall_s"]),
        ("faults injected", summary["faults"]),
        *((f"restarts: {LAYER_TITLES[k]}", v) for k, v in summary["restarts"].items()),
        *((f"recovery time: {LAYER_TITLES[k]} (s)", v) for k, v in summary["recovery_s"].items()),
        ("steps redone", summary["steps_redone"]),
        *([("changes of world size", summary["size_changes"])] if summary["size_changes"] else []),
    ]))
    if planning is not None:
        out.append("<h2>Goodput at scale (planner)</h2>")
        out.append(planning_html(*planning))
    for note in notes:
        out.append(f'<p class="empty">{html.escape(note)}</p>')
    out.append("</body></html>\n")
    return "".join(out)
