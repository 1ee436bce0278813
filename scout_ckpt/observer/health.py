"""Hardware health sources for the observer: anything with `poll() -> list[dict]` returning changes only.

Each returned dict becomes one `health` event: {"metric", "gpu", "old", "new", "severity", "message"}. The
observer polls at low frequency (every few seconds), so a source may call slow vendor APIs.

NvmlHealthSource watches one GPU through NVML (pynvml, from nvidia-ml-py): uncorrectable ECC counts (volatile
and aggregate), pending row remaps and remap failure, temperature against the slowdown and shutdown thresholds,
NVLink error counters, and the device falling off the bus (NVMLError_GpuIsLost). Without a GPU or driver
(nvmlInit raises NVMLError, e.g. NVMLError_LibraryNotFound) it logs one line and reports nothing, ever.
Every metric a GPU does not support (NVMLError_NotSupported, e.g. ECC off, no NVLink) is dropped at the first
poll. These GPU paths only run where NVML initialises; on CPU machines only the fallback runs.

Recordings: what one source read from a real GPU, call by call (`NvmlRecorder`, which scripts/gpu_check.py wraps
around pynvml on the device), replays through the same parsing on any machine (`RecordedNvml`, passed as
`NvmlHealthSource(nvml=...)`): the tests judge the parsing by real return values without a GPU.
"""

from __future__ import annotations

import json
import logging
from typing import Protocol

log = logging.getLogger("scout_ckpt.observer.health")


class HealthSource(Protocol):
    def poll(self) -> list[dict]: ...


class NullHealthSource:
    """No hardware to watch."""

    def poll(self) -> list[dict]:
        return []


def _nvlink_counters(nv) -> dict[str, int]:
    names = ("DL_REPLAY", "DL_RECOVERY", "DL_CRC_FLIT", "DL_CRC_DATA")
    return {n.lower(): getattr(nv, f"NVML_NVLINK_ERROR_{n}") for n in names if hasattr(nv, f"NVML_NVLINK_ERROR_{n}")}


class NvmlHealthSource:
    """One GPU (by NVML index) of this host."""

    def __init__(self, index: int = 0, nvml=None):
        """`nvml`: the pynvml module to read through (default: import it); a RecordedNvml or an NvmlRecorder."""
        self.index = index
        self.available = False
        self.lost = False
        self._last: dict[str, float] = {}
        self._unsupported: set[str] = set()
        try:
            if nvml is None:
                import pynvml

                nvml = pynvml
            nv = nvml

            nv.nvmlInit()
            count = nv.nvmlDeviceGetCount()
            if index >= count:
                log.info("health: GPU %d not present (%d GPUs); hardware health not watched", index, count)
                return
            self.nv = nv
            self.handle = nv.nvmlDeviceGetHandleByIndex(index)
            self.available = True
        except ImportError:
            log.info("health: pynvml (nvidia-ml-py) not installed; hardware health not watched")
        except Exception as e:  # pynvml.NVMLError and its subclasses, e.g. NVMLError_LibraryNotFound
            log.info("health: NVML unavailable (%s: %s); hardware health not watched", type(e).__name__, e)

    # ---- reading -------------------------------------------------------------------------------------------

    def _metrics(self) -> dict[str, float]:
        nv, h = self.nv, self.handle
        probes = {
            "ecc_uncorrected_volatile": lambda: nv.nvmlDeviceGetTotalEccErrors(
                h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC
            ),
            "ecc_uncorrected_aggregate": lambda: nv.nvmlDeviceGetTotalEccErrors(
                h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_AGGREGATE_ECC
            ),
            "remap": lambda: nv.nvmlDeviceGetRemappedRows(h),
            "temperature": lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
            "temp_slowdown": lambda: nv.nvmlDeviceGetTemperatureThreshold(h, nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
            "temp_shutdown": lambda: nv.nvmlDeviceGetTemperatureThreshold(h, nv.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN),
        }
        out: dict[str, float] = {}
        for name, probe in probes.items():
            if name in self._unsupported:
                continue
            try:
                v = probe()
            except nv.NVMLError_GpuIsLost:
                raise
            except nv.NVMLError:
                self._unsupported.add(name)
                continue
            if name == "remap":
                _corr, unc, pending, failure = v
                out.update(remap_uncorrectable_rows=unc, remap_pending=pending, remap_failure=failure)
            else:
                out[name] = v
        out.update(self._nvlink())
        return out

    def _nvlink(self) -> dict[str, float]:
        nv, h = self.nv, self.handle
        out: dict[str, float] = {}
        for link in range(getattr(nv, "NVML_NVLINK_MAX_LINKS", 0)):
            key = f"nvlink{link}"
            if key in self._unsupported:
                continue
            try:
                if not nv.nvmlDeviceGetNvLinkState(h, link):
                    continue
                for cname, counter in _nvlink_counters(nv).items():
                    out[f"nvlink{link}_{cname}"] = nv.nvmlDeviceGetNvLinkErrorCounter(h, link, counter)
            except nv.NVMLError_GpuIsLost:
                raise
            except nv.NVMLError:
                self._unsupported.add(key)
        return out

    # ---- changes -------------------------------------------------------------------------------------------

    def poll(self) -> list[dict]:
        if not self.available or self.lost:
            return []
        try:
            now = self._metrics()
        except self.nv.NVMLError_GpuIsLost as e:
            self.lost = True
            return [
                {
                    "metric": "gpu_lost",
                    "gpu": self.index,
                    "old": 0,
                    "new": 1,
                    "severity": "fatal",
                    "message": f"GPU {self.index} fell off the bus ({e})",
                }
            ]
        events = []
        first = not self._last
        for name, value in now.items():
            old = self._last.get(name)
            self._last[name] = value
            event = self._judge(name, old, value, now, first)
            if event:
                events.append(event)
        return events

    def _judge(self, name: str, old, new, now: dict, first: bool) -> dict | None:
        ev = {"metric": name, "gpu": self.index, "old": old, "new": new}
        if name == "temperature":
            slow, shut = now.get("temp_slowdown"), now.get("temp_shutdown")
            level = "shutdown" if shut and new >= shut else "slowdown" if slow and new >= slow else None
            old_level = (
                "shutdown"
                if shut and old is not None and old >= shut
                else "slowdown"
                if slow and old is not None and old >= slow
                else None
            )
            if level != old_level and (level or not first):
                return {
                    **ev,
                    "severity": "fatal" if level == "shutdown" else "warning" if level else "info",
                    "message": f"GPU {self.index} at {new} C: "
                    + (f"at or above the {level} threshold" if level else "back below thresholds"),
                }
            return None
        if name in ("temp_slowdown", "temp_shutdown"):
            return None
        if first:  # report standing faults once; counters that are merely nonzero are history
            if name in ("remap_pending", "remap_failure") and new:
                return {
                    **ev,
                    "severity": "fatal" if name == "remap_failure" else "warning",
                    "message": f"GPU {self.index}: {name.replace('_', ' ')}",
                }
            return None
        if new != old and new > (old or 0):
            severity = "fatal" if name in ("ecc_uncorrected_volatile", "remap_failure") else "warning"
            return {**ev, "severity": severity, "message": f"GPU {self.index}: {name} {old} -> {new}"}
        return None


# ---- recordings ------------------------------------------------------------------------------------------------

_HANDLE = "<handle>"


def _key(name: str, args: tuple) -> str:
    """A call's key in a recording: its name and its arguments, the device handle written as <handle>."""
    shown = (_HANDLE if a == _HANDLE or not isinstance(a, (int, float, str)) else repr(a) for a in args)
    return f"{name}({', '.join(shown)})"


class NvmlRecorder:
    """A pynvml stand-in that forwards every call to the real module and records what came back (a value, or the
    NVMLError subclass raised), per poll, in the form RecordedNvml replays. Constants and error classes pass
    through."""

    def __init__(self, nv):
        self._nv = nv
        self.calls: list[dict] = []

    def __getattr__(self, name: str):
        real = getattr(self._nv, name)
        if not name.startswith("nvml") or not callable(real):
            return real

        def call(*args):
            try:
                value = real(*args)
            except self._nv.NVMLError as e:
                self.calls.append({"call": _key(name, args), "error": type(e).__name__})
                raise
            if isinstance(value, tuple):
                shown = list(value)
            elif value is None or isinstance(value, (int, float, str)):
                shown = value
            elif isinstance(value, bytes):
                shown = value.decode(errors="replace")
            else:  # a device handle (a ctypes pointer)
                shown = _HANDLE
            self.calls.append({"call": _key(name, args), "result": shown})
            return value

        return call

    def recording(self, **about) -> dict:
        """The recording: `about` (device name, driver, ...), the NVML_* constants the parsing reads, the calls."""
        consts = {
            n: getattr(self._nv, n)
            for n in dir(self._nv)
            if n.startswith(
                (
                    "NVML_MEMORY_ERROR_TYPE_",
                    "NVML_VOLATILE_ECC",
                    "NVML_AGGREGATE_ECC",
                    "NVML_TEMPERATURE_",
                    "NVML_NVLINK_MAX_LINKS",
                    "NVML_NVLINK_ERROR_DL_",
                )
            )
            and isinstance(getattr(self._nv, n), int)
        }
        return {**about, "constants": consts, "calls": self.calls}


class _NvmlError(Exception):
    """pynvml.NVMLError's stand-in in a replay."""


class RecordedNvml:
    """Replays a recording (NvmlRecorder.recording, or a JSON file of one) as the pynvml module: each call returns
    the next value recorded for the same call and arguments (the last one again once they run out), or raises the
    NVMLError subclass of that name. A call never recorded raises NVMLError_NotSupported, as NVML does for a
    metric a GPU lacks."""

    def __init__(self, recording: dict | str):
        if isinstance(recording, dict):
            data: dict = recording
        else:
            with open(recording) as f:
                data = json.load(f)
        recording = data
        self.recording = data
        for name, value in recording.get("constants", {}).items():
            setattr(self, name, value)
        self.NVMLError = _NvmlError
        self._errors: dict[str, type] = {}
        self._queues: dict[str, list] = {}
        for c in recording["calls"]:
            self._queues.setdefault(c["call"], []).append(c)
            if "error" in c:
                self._error(c["error"])
        for name in ("NVMLError_NotSupported", "NVMLError_GpuIsLost", "NVMLError_LibraryNotFound"):
            self._error(name)

    def _error(self, name: str) -> type:
        if name == "NVMLError":  # an error code pynvml has no subclass for: the base class itself
            return _NvmlError
        if name not in self._errors:
            self._errors[name] = type(name, (_NvmlError,), {})
            setattr(self, name, self._errors[name])
        return self._errors[name]

    def __getattr__(self, name: str):
        if not name.startswith("nvml"):
            raise AttributeError(name)

        def call(*args):
            q = self._queues.get(_key(name, args))
            if not q:
                raise self._error("NVMLError_NotSupported")(f"{_key(name, args)} not in the recording")
            c = q.pop(0) if len(q) > 1 else q[0]
            if "error" in c:
                raise self._error(c["error"])(c["call"])
            return tuple(c["result"]) if isinstance(c["result"], list) else c["result"]

        return call


def default_source(local_rank: int | None) -> HealthSource:
    """The source an observer uses when given none: NVML for this process's GPU, or nothing."""
    src = NvmlHealthSource(local_rank or 0)
    return src if src.available else NullHealthSource()


__all__ = ["HealthSource", "NullHealthSource", "NvmlHealthSource", "NvmlRecorder", "RecordedNvml", "default_source"]
