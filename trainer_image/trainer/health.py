"""Node health checks behind NVRx's ``inprocess.health_check.HealthCheck`` interface.

Each check is a callable ``check(state) -> state`` that raises ``NodeUnhealthy`` when this node should not
keep training; the Wrapper runs them after every in-process fault, and ``resiliency`` runs them once at
start. An unhealthy rank exits ``UNHEALTHY_NODE`` (201): the cluster replaces the node.

- ``GpuHealthCheck`` (NVML): uncorrected volatile ECC errors, pending retired pages, critical XID events,
  hardware/thermal clock slowdown.
- ``NvLinkHealthCheck`` (NVML): every NVLink that was active at the first check is still active.
- ``NicHealthCheck`` (sysfs): physical NICs (``class/net/*`` with a ``device`` link) and InfiniBand ports
  (``class/infiniband/*/ports/*/state``): at the first check at least one NIC is up and every HCA has an
  ACTIVE port; afterwards everything that was up stays up.

Absent hardware (no NVML library, no GPU, no HCA: a CPU machine) makes a check a no-op, logged once.
NVML and sysfs are injectable (``nvml=``, ``sysfs_root=``) so the unhealthy cases are tested with fakes.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from nvidia_resiliency_ext.inprocess.health_check import HealthCheck

log = logging.getLogger(__name__)

# NVML constants (pynvml names), repeated so fakes need not import pynvml.
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_FEATURE_ENABLED = 1
NVML_NVLINK_MAX_LINKS = 18
NVML_EVENT_TYPE_XID_CRITICAL = 0x0000000000000008
THROTTLE_HW_SLOWDOWN = 0x0000000000000008
THROTTLE_SW_THERMAL = 0x0000000000000020
THROTTLE_HW_THERMAL = 0x0000000000000040
UNHEALTHY_THROTTLE = THROTTLE_HW_SLOWDOWN | THROTTLE_SW_THERMAL | THROTTLE_HW_THERMAL
IB_ACTIVE = "ACTIVE"


class NodeUnhealthy(RuntimeError):
    """This node failed a health check; the message names the device and the symptom."""


def load_nvml() -> Any | None:
    """The initialised ``pynvml`` module, or None when the NVML library or a GPU is absent."""
    try:
        import pynvml  # noqa: PLC0415 - optional; absent or unusable on CPU machines

        pynvml.nvmlInit()
        if pynvml.nvmlDeviceGetCount() == 0:
            return None
        return pynvml
    except Exception as exc:  # NVMLError_LibraryNotFound, ImportError, driver not loaded ...
        log.info("NVML unavailable (%s): GPU and NVLink health checks are skipped", type(exc).__name__)
        return None


def _not_supported(nvml: Any, exc: Exception) -> bool:
    err = getattr(nvml, "NVMLError", None)
    return err is not None and isinstance(exc, err)


class GpuHealthCheck(HealthCheck):
    def __init__(self, device_index: int, nvml: Any | None = None) -> None:
        self.nvml = nvml
        self.index = device_index
        self._events = None
        if nvml is not None:
            self.handle = nvml.nvmlDeviceGetHandleByIndex(device_index)
            try:
                self._events = nvml.nvmlEventSetCreate()
                nvml.nvmlDeviceRegisterEvents(self.handle, NVML_EVENT_TYPE_XID_CRITICAL, self._events)
            except Exception as exc:
                if not _not_supported(nvml, exc):
                    raise
                self._events = None

    def __call__(self, state: Any = None) -> Any:
        if self.nvml is None:
            return state
        problems = []
        ecc = self._read(self.nvml.nvmlDeviceGetTotalEccErrors, self.handle,
                         NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC)
        if ecc:
            problems.append(f"{ecc} uncorrected ECC errors")
        if self._read(self.nvml.nvmlDeviceGetRetiredPagesPendingStatus, self.handle) == NVML_FEATURE_ENABLED:
            problems.append("retired pages pending (reset the GPU)")
        throttle = self._read(self.nvml.nvmlDeviceGetCurrentClocksThrottleReasons, self.handle) or 0
        if throttle & UNHEALTHY_THROTTLE:
            problems.append(f"clocks throttled by hardware/thermal slowdown (reasons 0x{throttle:x})")
        if self._events is not None:
            try:
                event = self.nvml.nvmlEventSetWait(self._events, 0)
                if event.eventType & NVML_EVENT_TYPE_XID_CRITICAL:
                    problems.append(f"critical XID {event.eventData}")
            except Exception as exc:  # NVML_ERROR_TIMEOUT: no event pending
                if not _not_supported(self.nvml, exc):
                    raise
        if problems:
            raise NodeUnhealthy(f"GPU {self.index}: " + "; ".join(problems))
        return state

    def _read(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            if _not_supported(self.nvml, exc):
                return None  # not readable on this GPU/driver
            raise


class NvLinkHealthCheck(HealthCheck):
    def __init__(self, device_index: int, nvml: Any | None = None) -> None:
        self.nvml = nvml
        self.index = device_index
        self.baseline: set[int] | None = None

    def __call__(self, state: Any = None) -> Any:
        if self.nvml is None:
            return state
        handle = self.nvml.nvmlDeviceGetHandleByIndex(self.index)
        active = set()
        # After the baseline only its links are read (a link that comes up is no fault): one NVML call per active
        # link, none on a GPU without NVLink, instead of one per possible link on every check of every restart.
        links = range(NVML_NVLINK_MAX_LINKS) if self.baseline is None else sorted(self.baseline)
        for link in links:
            try:
                if self.nvml.nvmlDeviceGetNvLinkState(handle, link) == NVML_FEATURE_ENABLED:
                    active.add(link)
            except Exception as exc:
                if not _not_supported(self.nvml, exc):
                    raise  # link absent on this GPU: NotSupported / InvalidArgument
        if self.baseline is None:
            self.baseline = active
            return state
        down = sorted(self.baseline - active)
        if down:
            raise NodeUnhealthy(f"GPU {self.index}: NVLink(s) {down} went down (active at start: "
                                f"{sorted(self.baseline)})")
        return state


class NicHealthCheck(HealthCheck):
    def __init__(self, sysfs_root: str | Path = "/sys") -> None:
        self.root = Path(sysfs_root)
        self.baseline: set[str] | None = None

    def _read_state(self) -> tuple[dict[str, bool], dict[str, dict[str, bool]]]:
        nics = {}
        for iface in sorted((self.root / "class" / "net").glob("*")):
            if not (iface / "device").exists():  # lo, bridges, veth, ifb: virtual
                continue
            try:
                nics[iface.name] = (iface / "operstate").read_text().strip() == "up"
            except OSError:
                nics[iface.name] = False
        hcas: dict[str, dict[str, bool]] = {}
        for hca in sorted((self.root / "class" / "infiniband").glob("*")):
            ports = {}
            for port in sorted((hca / "ports").glob("*")):
                try:  # e.g. "4: ACTIVE"
                    ports[port.name] = (port / "state").read_text().split(":")[-1].strip() == IB_ACTIVE
                except OSError:
                    ports[port.name] = False
            hcas[hca.name] = ports
        return nics, hcas

    def __call__(self, state: Any = None) -> Any:
        nics, hcas = self._read_state()
        up = {f"net/{n}" for n, ok in nics.items() if ok}
        up |= {f"ib/{h}/{p}" for h, ports in hcas.items() for p, ok in ports.items() if ok}
        if self.baseline is None:
            problems = []
            if nics and not any(nics.values()):
                problems.append(f"no physical NIC is up ({sorted(nics)})")
            problems += [f"InfiniBand {h} has no ACTIVE port" for h, ports in hcas.items()
                         if ports and not any(ports.values())]
            if problems:
                raise NodeUnhealthy("; ".join(problems))
            self.baseline = up
            return state
        down = sorted(self.baseline - up)
        if down:
            raise NodeUnhealthy(f"link(s) went down: {down}")
        return state


def node_checks(local_rank: int, sysfs_root: str | Path = "/sys", nvml: Any | None = None) -> list[HealthCheck]:
    """The node's health checks; GPU/NVLink only when NVML sees a GPU for this local rank."""
    nvml = nvml if nvml is not None else load_nvml()
    checks: list[HealthCheck] = [NicHealthCheck(sysfs_root)]
    if nvml is not None and local_rank < nvml.nvmlDeviceGetCount():
        checks[:0] = [GpuHealthCheck(local_rank, nvml), NvLinkHealthCheck(local_rank, nvml)]
    return checks


class NodeHealth(HealthCheck):
    """All checks as one NVRx ``HealthCheck`` (the Wrapper's ``health_check`` takes one).

    The Wrapper calls it before each iteration's function and, after a fault, once more before the restart: an
    in-process restart would check the node twice within a fraction of a second, and the first iteration right
    after ``resiliency.run``'s start check. A check on entering an iteration is skipped when the node was checked
    just before it (``checked_for``: the start check covers iteration 0; the check after a fault in iteration i
    covers iteration i + 1). The check after a fault always runs."""

    def __init__(self, checks: list[HealthCheck], checked_for: int | None = None) -> None:
        self.checks = checks
        self.checked_for = checked_for
        self._entered: set[int] = set()

    def __call__(self, state: Any = None) -> Any:
        iteration = getattr(state, "iteration", None)
        entering = iteration is not None and iteration not in self._entered
        if iteration is not None:
            self._entered.add(iteration)
        if entering and iteration == self.checked_for:
            return state  # checked a moment ago
        for check in self.checks:
            check(state)
        if iteration is not None:
            self.checked_for = iteration + 1
        return state
