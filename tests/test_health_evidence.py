"""health evidence from observer events: which events taint a checkpoint, and what clears them (pure)."""

from scout_ckpt.save.evidence.health import health_evidence, taints

ECC = {
    "id": 7,
    "kind": "health",
    "ranks": [1],
    "step": 14,
    "time": 100.0,
    "detail": {"metric": "ecc_uncorrected_volatile", "old": 0, "new": 1, "severity": "fatal"},
}
PASSED = {"status": "pass", "reasons": []}


def test_what_taints():
    assert taints(ECC)
    assert taints({"kind": "desync", "ranks": [2], "detail": {}})
    assert not taints({"kind": "hang", "ranks": [2], "detail": {}})
    assert not taints({"kind": "crash", "ranks": [2], "detail": {}})
    assert not taints({"kind": "health", "ranks": [0], "detail": {"metric": "temperature", "severity": "warning"}})


def test_fsdp_shard_owner_with_ecc_is_not_certified():
    ev = health_evidence(
        [ECC], since=5, until=9, mode="fsdp", consensus={"status": "not_applicable"}, invariants=PASSED, vouching=False
    )
    assert ev["status"] == "fail"
    assert ev["reasons"] == [
        {"code": "health_fault", "ranks": [1], "event": 7, "metric": "ecc_uncorrected_volatile", "step": 14}
    ]


def test_ddp_cleared_by_consensus_after_the_event():
    ev = health_evidence([ECC], since=5, until=9, mode="ddp", consensus=PASSED, invariants=None, vouching=False)
    assert ev["status"] == "pass" and ev["cleared_by"] == "consensus" and ev["events"][0]["event"] == 7


def test_fsdp_cleared_by_vouching_invariants_only():
    ev = health_evidence(
        [ECC], since=5, until=9, mode="fsdp", consensus={"status": "not_applicable"}, invariants=PASSED, vouching=True
    )
    assert ev["status"] == "pass" and ev["cleared_by"] == "invariants"


def test_events_outside_the_window_do_not_count():
    assert (
        health_evidence([ECC], since=7, until=9, mode="fsdp", consensus=None, invariants=None, vouching=False)["status"]
        == "pass"
    )
    assert (
        health_evidence([ECC], since=None, until=6, mode="fsdp", consensus=None, invariants=None, vouching=False)[
            "status"
        ]
        == "pass"
    )


def test_window_runs_from_the_newest_certified_save():
    """An uncleared fault keeps failing later saves of the run (the state it may have corrupted is still there);
    a certified save moves the window on; an event after a save's evidence counts against the next save."""
    from scout_ckpt.save.evidence.health import HealthWindow

    win = HealthWindow()
    kw = dict(mode="fsdp", consensus={"status": "not_applicable"}, invariants=PASSED, vouching=False)
    assert win.evidence([ECC], until=6, **kw)["status"] == "pass"  # evidence taken before the event's receipt
    win.settled("certified", 6)
    assert win.evidence([ECC], until=8, **kw)["status"] == "fail"
    win.settled("rejected", 8)
    assert win.evidence([ECC], until=9, **kw)["status"] == "fail"  # still in doubt
    ddp = dict(kw, mode="ddp", consensus=PASSED)
    assert win.evidence([ECC], until=10, **ddp)["cleared_by"] == "consensus"
    win.settled("certified", 10)
    assert win.evidence([ECC], until=12, **kw)["status"] == "pass"


def test_an_event_from_a_host_whose_clock_is_behind_counts_by_its_receipt(tmp_path):
    """#25 item 6. A real ledger: a save certified, then an ECC from a host whose clock is 120 s behind the
    coordinator (its `time` falls before that save's evidence) is received; the next save's window holds it."""
    import time

    from scout_ckpt.ledger import Ledger
    from scout_ckpt.save.evidence.health import HealthWindow

    kw = dict(mode="fsdp", consensus={"status": "not_applicable"}, invariants=PASSED, vouching=False)
    win = HealthWindow()
    with Ledger.open(tmp_path, create=True) as led:
        led.add_event("health", step=3, ranks=[0], detail={"metric": "temperature", "severity": "warning"})
        first = led.last_event_id()
        assert win.evidence(led.events(), until=first, **kw)["status"] == "pass"
        win.settled("certified", first)
        led.add_event("health", step=4, ranks=[1], detail=ECC["detail"], when=time.time() - 120.0)
        ev = win.evidence(led.events(), until=led.last_event_id(), **kw)
    assert ev["status"] == "fail" and ev["reasons"][0]["ranks"] == [1], ev
