"""Goodput per booked GPU against the number of GPUs (8 to 16,384) for each configuration
(``simulate.CONFIGURATIONS``), from one run's costs, as a table and a PNG drawn with Pillow.

Every configuration runs the costs' snapshot interval and ``persist_every`` and the spare nodes the user asked for
(``--spares``) at the cluster's size; at the other sizes, the same share of the nodes, rounded. ``spares_for`` is
a suggestion the report prints as one, never applied:
``SUGGESTED_SPARES_PER_100_NODES`` per 100 nodes, at least one."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from trainer.planning.failures import FailureModel
from trainer.planning.simulate import CONFIGURATIONS, Cluster, Costs, simulate

SIZES = tuple(2 ** k for k in range(3, 15))  # 8 .. 16,384 GPUs
SUGGESTED_SPARES_PER_100_NODES = 2
GOAL = 0.95
COLOURS = {"today": (31, 119, 180), "no-inprocess": (255, 127, 14), "no-node-local": (148, 103, 189),
           "peer": (44, 160, 44)}
W, H, LEFT, RIGHT, TOP, BOTTOM = 900, 540, 70, 250, 40, 60


def spares_for(cluster: Cluster) -> int:
    """A suggested number of spare nodes for the cluster's size (printed as a suggestion; ``--spares`` decides)."""
    nodes = cluster.gpus // cluster.gpus_per_node
    return max(1, math.ceil(nodes * SUGGESTED_SPARES_PER_100_NODES / 100))


def curves(costs: Costs, cluster: Cluster, model: FailureModel, *, sizes: tuple[int, ...] = SIZES,
           days: float = 30.0, trials: int = 64, seed: int = 0) -> dict[str, list[dict[str, Any]]]:
    """Per configuration, per size: goodput, its 95 % interval, per booked GPU, and the spares used."""
    out: dict[str, list[dict[str, Any]]] = {}
    for key, layers in CONFIGURATIONS.items():
        points = []
        for gpus in sizes:
            if gpus < cluster.gpus_per_node:
                continue
            at = replace(cluster, gpus=gpus, spare_nodes=round(cluster.spare_nodes * gpus / cluster.gpus))
            result = simulate(costs, at, model, layers, days=days, trials=trials, seed=seed)
            points.append({"gpus": gpus, "goodput": round(result.goodput, 4), "ci95": round(result.ci95, 4),
                           "goodput_per_booked_gpu": round(result.goodput_per_booked_gpu, 4),
                           "spares": at.spare_nodes})
        out[key] = points
    return out


def draw(data: dict[str, list[dict[str, Any]]], path: str | Path, title: str) -> Path:
    """The curves as a PNG: log2 GPUs across, goodput per booked GPU up, the goal (0.95) dashed."""
    image = Image.new("RGB", (W, H), "white")
    pen = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    sizes = sorted({p["gpus"] for points in data.values() for p in points}) or [8, 16384]
    lows = [p["goodput_per_booked_gpu"] for points in data.values() for p in points]
    y_lo = min([GOAL - 0.02, *lows])
    y_lo = math.floor(y_lo * 50) / 50
    x0, x1 = math.log2(sizes[0]), math.log2(sizes[-1])

    def sx(gpus: float) -> float:
        return LEFT + (math.log2(gpus) - x0) / ((x1 - x0) or 1) * (W - LEFT - RIGHT)

    def sy(value: float) -> float:
        return TOP + (1.0 - value) / ((1.0 - y_lo) or 1) * (H - TOP - BOTTOM)

    pen.rectangle([LEFT, TOP, W - RIGHT, H - BOTTOM], outline=(150, 150, 150))
    steps = 10 if 1.0 - y_lo <= 0.2 else 5
    for i in range(steps + 1):
        value = y_lo + (1.0 - y_lo) * i / steps
        pen.line([LEFT, sy(value), W - RIGHT, sy(value)], fill=(235, 235, 235))
        pen.text((LEFT - 45, sy(value) - 6), f"{value:.3f}", fill="black", font=font)
    for gpus in sizes:
        pen.text((sx(gpus) - 12, H - BOTTOM + 6), f"{gpus:,}", fill="black", font=font)
    x = LEFT
    while x < W - RIGHT:  # the goal, dashed
        pen.line([x, sy(GOAL), min(x + 8, W - RIGHT), sy(GOAL)], fill=(200, 0, 0))
        x += 14
    pen.text((W - RIGHT + 6, sy(GOAL) - 6), f"goal {GOAL:.2f}", fill=(200, 0, 0), font=font)
    for n, (key, points) in enumerate(data.items()):
        colour = COLOURS.get(key, (80, 80, 80))
        line = [(sx(p["gpus"]), sy(p["goodput_per_booked_gpu"])) for p in points]
        if len(line) > 1:  # the first drawn widest: curves that coincide stay visible beneath each other
            pen.line(line, fill=colour, width=max(3, 9 - 2 * n))
        for px, py in line:
            pen.ellipse([px - 3, py - 3, px + 3, py + 3], fill=colour)
        pen.rectangle([W - RIGHT + 10, TOP + 30 + n * 22, W - RIGHT + 24, TOP + 44 + n * 22], fill=colour)
        pen.text((W - RIGHT + 30, TOP + 32 + n * 22), CONFIGURATIONS[key].name if key in CONFIGURATIONS else key,
                 fill="black", font=font)
    pen.text((LEFT, 12), title, fill="black", font=font)
    pen.text(((LEFT + W - RIGHT) / 2 - 30, H - 24), "GPUs (log scale)", fill="black", font=font)
    pen.text((8, TOP - 20), "goodput per booked GPU", fill="black", font=font)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    image.save(out, format="PNG")
    return out
