"""The goodput planner: what share of a job's time on N GPUs is training, what each recovery layer buys, and which
settings to use, from a run's own measured costs and a failure model with sources (``PLANNING.md``).

- ``failures``: failure models (rates per GPU-hour by class, each class mapped to the layer that recovers it);
- ``costs``: a finished run's ledger and metrics (or a costs file written by hand) -> measured costs;
- ``simulate``: the discrete-event simulation of a job under a failure model, N trials, a confidence interval;
- ``replay``: a recorded run's own fault schedule and costs -> its predicted goodput;
- ``recommend``: the snapshot interval, ``persist_every``, spares and replicas that maximise goodput;
- ``chart``: goodput against the number of GPUs per configuration, as a PNG.

numpy and Pillow only: no torch, so ``components`` can run it through ``python -m trainer.plan`` and its tests are
fast. Bad input raises ``PlanError`` (one line; the CLI exits 2).
"""

from __future__ import annotations

LAYERS = ("inprocess", "injob", "node", "cluster")
"""The recovery layers, as the recovery ledger names them (``trainer.ledger``)."""


class PlanError(ValueError):
    """Bad planner input: the message is one line that says what to change."""
