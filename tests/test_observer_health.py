"""Hardware health in the observer: a fake source's ECC increase becomes one `health` event; the real NVML
source on a machine without a GPU says so once and stays quiet."""

from __future__ import annotations

import json
import logging
import time

import pytest

from scout_ckpt.errors import ScoutError
from scout_ckpt.ledger import Ledger
from scout_ckpt.observer.daemon import Observer, channel_dir
from scout_ckpt.observer.health import NullHealthSource, NvmlHealthSource, default_source

pytestmark = pytest.mark.timing  # its outcome depends on timing: `make stress` runs it under load


def _nvml_present() -> bool:
    return NvmlHealthSource(0).available


def _run_observer(root, run_id, health_source) -> Observer:
    """One observer (world of one, no process group needed), watched for a few health polls."""
    Ledger.open(root, create=True).close()
    return Observer.start(
        root,
        rank=0,
        world_size=1,
        run_id=run_id,
        stall_s=600.0,
        poll_s=0.05,
        health_source=health_source,
        health_poll_s=0.1,
        trace=False,
    )


def _wait_until(what: str, cond, timeout: float = 60.0):
    """Poll `cond()` until it returns something truthy, or fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    pytest.fail(f"{what}: not within {timeout}s")


def _read_int(path) -> int:
    try:
        return int(path.read_text())
    except (FileNotFoundError, ValueError):
        return 0


def test_fake_source_ecc_increase_is_one_health_event(tmp_path):
    polls = tmp_path / "polls"
    obs = _run_observer(
        tmp_path,
        "health-fake",
        {"factory": "tests.fake_health:FakeEccSource", "kwargs": {"at": 2, "count_file": str(polls)}},
    )
    try:

        def event():
            with Ledger.open(tmp_path, readonly=True) as ledger:
                return ledger.events()

        _wait_until("the health event", event)
        # nothing more may appear after it: wait until the observer has started poll 5, so polls 3 and 4 (which
        # report nothing new) have run to the end, their events (none) written
        _wait_until("three more health polls", lambda: _read_int(polls) >= 5)
    finally:
        obs.stop()
    with Ledger.open(tmp_path, readonly=True) as ledger:
        events = ledger.events()
    assert len(events) == 1, events
    ev = events[0]
    assert ev["kind"] == "health" and ev["ranks"] == [0]
    assert ev["detail"]["metric"] == "ecc_uncorrected_volatile" and ev["detail"]["new"] == 1
    assert (tmp_path / ev["detail"]["report"]).exists()


class _Unpicklable:
    def poll(self):
        return []


@pytest.mark.parametrize(
    "source",
    [
        _Unpicklable(),
        {"factory": "no-colon"},
        {"factory": "m:f", "kwargs": {"x": object()}},
        {"factory": "m:f", "extra": 1},
    ],
)
def test_health_source_must_be_a_json_description(tmp_path, source):
    """The observer's config and side channel are JSON only: an object (which would need a pickle) is refused
    before any process starts, and nothing is written."""
    with pytest.raises(ScoutError, match="health_source"):
        Observer.start(tmp_path, rank=0, world_size=1, run_id="bad-health", health_source=source, trace=False)
    assert not channel_dir(tmp_path, "bad-health").exists()


def test_observer_config_and_channel_hold_no_pickle(tmp_path):
    obs = _run_observer(tmp_path, "health-json", "tests.fake_health:FakeEccSource")
    try:
        cfg = (channel_dir(tmp_path, "health-json") / "observer-0.json").read_text()
    finally:
        obs.stop()
    assert '"factory": "tests.fake_health:FakeEccSource"' in cfg or '"factory":"tests.fake_health:FakeEccSource"' in cfg
    for f in channel_dir(tmp_path, "health-json").rglob("*.json"):
        json.loads(f.read_text())  # every file of the channel is plain JSON


@pytest.mark.skipif(_nvml_present(), reason="this machine has an NVML GPU: the no-GPU fallback cannot be seen")
def test_nvml_source_without_gpu_is_quiet(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="scout_ckpt.observer.health"):
        src = NvmlHealthSource(0)
        assert not src.available
        assert src.poll() == [] and src.poll() == []
    lines = [r for r in caplog.records if r.name == "scout_ckpt.observer.health"]
    assert len(lines) == 1 and "not watched" in lines[0].getMessage()
    assert isinstance(default_source(0), NullHealthSource)

    # the observer's default source: one line in its log, no events, however many rounds the observer runs
    obs = _run_observer(tmp_path, "health-none", None)
    log_path = channel_dir(tmp_path, "health-none") / "observer-0.log"
    status = channel_dir(tmp_path, "health-none") / "status-0.json"

    def beat() -> int:
        try:
            return json.loads(status.read_text())["beat"]
        except (FileNotFoundError, json.JSONDecodeError):
            return 0

    try:
        _wait_until(
            "the observer's health line",
            lambda: log_path.exists() and "hardware health not watched" in log_path.read_text(),
        )
        first = beat()
        # three more status rounds (0.5 s apart; a health poll every 0.1 s in between) after the line
        _wait_until("three more observer rounds", lambda: beat() >= first + 3)
    finally:
        obs.stop()
    with Ledger.open(tmp_path, readonly=True) as ledger:
        assert ledger.events() == []
    log_text = log_path.read_text()
    assert log_text.count("hardware health not watched") == 1


class _FakeNvml:
    """A stand-in for the pynvml module with one GPU whose counters the test moves (the GPU code paths of
    NvmlHealthSource, exercised on a CPU machine)."""

    class NVMLError(Exception):
        pass

    class NVMLError_GpuIsLost(NVMLError):
        pass

    NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC, NVML_AGGREGATE_ECC = 1, 0, 1
    NVML_TEMPERATURE_GPU, NVML_TEMPERATURE_THRESHOLD_SLOWDOWN, NVML_TEMPERATURE_THRESHOLD_SHUTDOWN = 0, 1, 0
    NVML_NVLINK_MAX_LINKS, NVML_NVLINK_ERROR_DL_REPLAY = 1, 0

    def __init__(self):
        self.ecc = {0: 0, 1: 5}
        self.temp, self.lost = 60, False

    def _check(self):
        if self.lost:
            raise self.NVMLError_GpuIsLost("GPU is lost")

    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):
        self._check()
        return self.ecc[counter]

    def nvmlDeviceGetRemappedRows(self, h):
        self._check()
        return (0, 0, 0, 0)

    def nvmlDeviceGetTemperature(self, h, sensor):
        self._check()
        return self.temp

    def nvmlDeviceGetTemperatureThreshold(self, h, which):
        return {1: 90, 0: 100}[which]

    def nvmlDeviceGetNvLinkState(self, h, link):
        raise self.NVMLError("Not Supported")


def test_nvml_diff_rules_on_a_fake_nvml():
    nv = _FakeNvml()
    src = NvmlHealthSource.__new__(NvmlHealthSource)
    src.index, src.available, src.lost, src._last, src._unsupported = 0, True, False, {}, set()
    src.nv, src.handle = nv, object()
    assert src.poll() == []  # standing counts are history, not events
    nv.ecc[0] += 1
    assert [(e["metric"], e["old"], e["new"]) for e in src.poll()] == [("ecc_uncorrected_volatile", 0, 1)]
    nv.temp = 95
    assert [e["metric"] for e in src.poll()] == ["temperature"]
    assert src.poll() == []
    nv.lost = True
    lost = src.poll()
    assert [e["metric"] for e in lost] == ["gpu_lost"] and src.poll() == []
