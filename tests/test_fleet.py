"""The fleet record without training processes: the triage rule, the suspects' score and drain commands, the
options, the store's behaviour when lost, locked or unwritable, `fleet import` from a real ledger, and every fleet
command's bad input (exit 2, one line, nothing written). The torchrun jobs are tests/test_fleet_jobs.py."""

from __future__ import annotations

import json
import shlex
import sqlite3
import time
from pathlib import Path

import pytest

from scout_ckpt.errors import BadOption
from scout_ckpt.fleet import suspects as rule
from scout_ckpt.fleet.recorder import FleetRecorder, sync_root
from scout_ckpt.fleet.store import FleetStore
from scout_ckpt.ledger import Ledger
from scout_ckpt.options import EXIT_SUSPECT_DEVICE, FleetOptions, as_fleet
from scout_ckpt.replay import loss_triage as loss_rule
from scout_ckpt.replay.triage import classify, other_rank
from tests.conftest import run_cli

# ---- triage: the pure rule ------------------------------------------------------------------------------------

G, W, N1, N2 = (1, 2), (9, 9), (3, 4), (5, 6)


def test_triage_rank_disagrees_again_is_persistent():
    assert classify([W, W], [G, G]) == "persistent"


def test_triage_rank_that_flickers_is_persistent():
    assert classify([W, G], [G, G]) == "persistent"


def test_triage_rank_agreeing_on_rerun_is_transient():
    assert classify([G, G], [G, G]) == "transient"


def test_triage_other_rank_reproducing_the_disagreement_is_not_hardware():
    assert classify([N1, N2], [N1, N2]) == "not_hardware"


def test_triage_failed_rerun_is_unclassified():
    assert classify([G, None], [G, G]) is None


def test_other_rank_prefers_another_node_not_attributed():
    nodes = {0: ("h", 0), 1: ("h", 0), 2: ("h", 1), 3: ("h", 1)}
    assert other_rank(1, [0, 1, 2, 3], nodes, {1, 2}) == 3


def test_other_rank_prefers_another_host_to_another_node_of_the_same_host():
    nodes = {0: ("a", 0), 1: ("a", 1), 2: ("b", 2)}
    assert other_rank(0, [0, 1, 2], nodes, {0}) == 2


def test_other_rank_without_torchrun_nodes_still_prefers_another_host():
    nodes = {0: ("a", None), 1: ("a", None), 2: ("b", None)}
    assert other_rank(0, [0, 1, 2], nodes, {0}) == 2


def test_other_rank_on_one_node_is_the_next_peer():
    assert other_rank(2, [0, 1, 2], {0: ("h", None), 1: ("h", None), 2: ("h", None)}, {2}) == 0


# ---- triage from the loss: the pure rules (replay.loss_triage) ---------------------------------------------------

FLAT = [2.0 + 0.01 * (k % 5) for k in range(20)]  # a loss wobbling by 0.04 around 2.02


def test_a_nan_loss_is_non_finite_even_without_history():
    assert loss_rule.anomaly(float("nan"), [])[0] == "non_finite"


def test_an_infinite_loss_is_non_finite():
    assert loss_rule.anomaly(float("inf"), FLAT)[0] == "non_finite"


def test_a_loss_ten_times_the_window_is_a_spike():
    assert loss_rule.anomaly(20.0, FLAT)[0] == "spike"


def test_a_loss_within_the_windows_spread_is_no_anomaly():
    assert loss_rule.anomaly(2.05, FLAT)[0] is None


def test_a_falling_loss_is_no_anomaly():
    assert loss_rule.anomaly(0.1, FLAT)[0] is None


def test_no_spike_before_the_minimum_history():
    assert loss_rule.anomaly(20.0, FLAT[: loss_rule.LOSS_MIN_HISTORY - 1])[0] is None


def test_a_flat_loss_needs_the_relative_floor_to_spike():
    # every past loss equal: MAD 0; the spread is 5% of the median, so 2.5 (z = 5) is not a spike, 4 (z = 20) is
    flat = [2.0] * 20
    assert (loss_rule.anomaly(2.5, flat)[0], loss_rule.anomaly(4.0, flat)[0]) == (None, "spike")


def test_loss_triage_rank_differing_from_the_other_is_persistent():
    assert loss_rule.classify([W, W], [G, G], True, False) == "persistent"


def test_loss_triage_live_step_differing_from_agreeing_reruns_is_transient():
    assert loss_rule.classify([G, G], [G, G], False, False) == "transient"


def test_loss_triage_nonfinite_result_reproduced_elsewhere_is_not_hardware():
    assert loss_rule.classify([G, G], [G, G], True, True) == "not_hardware"


def test_loss_triage_finite_result_reproduced_elsewhere_is_transient():
    assert loss_rule.classify([G, G], [G, G], True, False) == "transient"


def test_loss_triage_other_rank_disagreeing_with_itself_is_not_hardware():
    assert loss_rule.classify([N1, N1], [N1, N2], True, False) == "not_hardware"


def test_loss_triage_failed_rerun_is_unclassified():
    assert loss_rule.classify([G, G], [G, None], True, False) is None


# ---- suspects: the score rule and the drain commands ----------------------------------------------------------


def _v(device, kind="sdc", cls="persistent", job="j1", run="r1", t=100.0, host="h1", local=0):
    return {
        "device": device,
        "kind": kind,
        "class": cls,
        "job": job,
        "run_id": run,
        "time": t,
        "host": host,
        "local_rank": local,
        "uuid": None,
        "serial": None,
    }


def test_score_counts_class_kind_and_jobs():
    rows = [_v("d1", job="j1"), _v("d1", job="j2"), _v("d2", cls="transient", host="h2")]
    got = {s["device"]: s for s in rule.rank(rows)}
    assert got["d1"]["score"] == 3 * 2 + 3 * 2 + 2  # two persistent sdc, one job beyond the first


def test_transient_device_scores_a_quarter_weight():
    assert rule.rank([_v("d2", cls="transient")])[0]["score"] == 0.75


def test_persistent_before_transient():
    rows = [_v("d2", cls="transient", t=200), _v("d1", kind="straggler")]
    assert [s["device"] for s in rule.rank(rows)] == ["d1", "d2"]


def test_not_hardware_lists_no_device():
    assert rule.rank([_v("d1", cls="not_hardware")]) == []


def test_untriaged_verdicts_in_two_runs_make_a_persistent_suspect():
    rows = [_v("d1", kind="hang", cls=None, run="r1"), _v("d1", kind="hang", cls=None, run="r2")]
    assert rule.rank(rows)[0]["class"] == "persistent"


def test_untriaged_verdict_once_is_transient():
    assert rule.rank([_v("d1", kind="hang", cls=None)])[0]["class"] == "transient"


def test_min_score_leaves_out_low_scores():
    assert rule.rank([_v("d2", cls="transient")], min_score=1.0) == []


def test_slurm_lines_parse_back():
    rows = [
        _v("GPU-1234", host="node-7", local=3, job="j1"),
        _v("GPU-1234", host="node-7", local=3, job="j2"),
        _v("d9", cls="transient", host="node-8"),
    ]
    lines = rule.slurm(rule.rank(rows))
    assert len(lines) == 1
    words = shlex.split(lines[0])
    fields = dict(w.split("=", 1) for w in words[2:])
    assert (words[:2], fields["NodeName"], fields["State"]) == (["scontrol", "update"], "node-7", "DRAIN")
    assert fields["Reason"].startswith("scout-ckpt: persistent sdc on GPU-1234")


def test_k8s_lines_cordon_and_taint_the_host():
    lines = rule.k8s(rule.rank([_v("GPU-1234", host="node-7")]))
    assert [shlex.split(x)[:3] for x in lines] == [["kubectl", "cordon", "node-7"], ["kubectl", "taint", "nodes"]]


def test_a_host_name_cannot_inject_shell():
    lines = rule.slurm(rule.rank([_v("d1", host='n1"; rm -rf /; "')]))
    assert len(shlex.split(lines[0])) == 5


# ---- options ------------------------------------------------------------------------------------------------------


def test_fleet_option_from_the_environment():
    assert as_fleet(True, environ={"SCOUT_CKPT_FLEET": "/x/f.db"}).path == "/x/f.db"


def test_fleet_false_is_off_whatever_the_environment(monkeypatch):
    monkeypatch.setenv("SCOUT_CKPT_FLEET", "/x/f.db")
    assert as_fleet(False) is None


def test_fleet_bad_on_suspect_fails_at_construction():
    with pytest.raises(BadOption, match="on_suspect"):
        FleetOptions.from_dict({"path": "/x/f.db", "on_suspect": "reboot"})


def test_fleet_unknown_key_fails():
    with pytest.raises(BadOption, match="unknown option"):
        FleetOptions.from_dict({"path": "/x/f.db", "interval": 3})


def test_exit_code_is_none_of_the_clis():
    assert EXIT_SUSPECT_DEVICE not in (0, 1, 2, 130) and EXIT_SUSPECT_DEVICE < 128


def test_fleet_path_accepts_a_pathlike(tmp_path):
    assert FleetOptions(path=tmp_path / "f.db").path == str(tmp_path / "f.db")


# ---- a real ledger and store ----------------------------------------------------------------------------------


def _root(tmp_path: Path, name="run", *, host="node-a", kinds=(("sdc", 1),), cls="persistent") -> Path:
    """A ROOT whose ledger holds one run of 2 ranks on `host` and events naming rank R (written through the
    ledger's own API, as a job writes them)."""
    root = tmp_path / name
    root.mkdir()
    with Ledger.open(root, create=True) as led:
        led.begin_run("run-1", world_size=2, topology={}, policy={}, versions={})
        led.record_ranks(
            "run-1",
            [
                {
                    "rank": r,
                    "host": host,
                    "node_rank": 0,
                    "local_rank": r,
                    "pid": 1,
                    "device": {
                        "host": host,
                        "local_rank": r,
                        "device": f"{host}:cpu{r}",
                        "uuid": None,
                        "serial": None,
                        "job": f"job-{name}",
                    },
                }
                for r in range(2)
            ],
        )
        for kind, rank in kinds:
            detail = {"source": "replay", "triage": {"class": cls}} if kind == "sdc" else {}
            led.add_event(kind, step=4, ranks=[rank], run_id="run-1", detail=detail)
    return root


def test_import_names_the_device_job_and_root(tmp_path):
    root = _root(tmp_path)
    with FleetStore.open(tmp_path / "f.db") as store:
        sync_root(store, root)
        (v,) = store.verdicts()
    assert (v["device"], v["host"], v["local_rank"], v["job"], v["root"], v["step"], v["class"]) == (
        "node-a:cpu1",
        "node-a",
        1,
        "job-run",
        str(root.resolve()),
        4,
        "persistent",
    )


def test_reimport_keeps_one_row_per_event(tmp_path):
    root = _root(tmp_path)
    with FleetStore.open(tmp_path / "f.db") as store:
        sync_root(store, root)
        store.conn.execute("UPDATE roots SET last_event=0")  # the cursor lost: everything read again
        assert sync_root(store, root) == 0


def test_not_hardware_record_has_no_device(tmp_path):
    root = _root(tmp_path, cls="not_hardware")
    with FleetStore.open(tmp_path / "f.db") as store:
        sync_root(store, root)
        (v,) = store.verdicts()
    assert (v["device"], v["host"], v["detail"]["ran_on"]["device"]) == (None, None, "node-a:cpu1")


def _until(cond, timeout_s: float = 30.0) -> None:
    """Wait for the recorder's thread to reach a state (its rounds, not the wall clock, order the test)."""
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)


def test_recorder_with_a_lost_store_directory_never_raises_and_retries(tmp_path, caplog):
    root = _root(tmp_path)
    rec = FleetRecorder(tmp_path / "gone" / "f.db", root, interval_s=0.05)
    _until(lambda: rec.failures >= 2)
    rec.close()
    assert rec.failures >= 2 and rec.recorded == 0


def test_recorder_logs_could_not_record_once(tmp_path, caplog):
    root = _root(tmp_path)
    with caplog.at_level("WARNING", logger="scout_ckpt"):
        rec = FleetRecorder(tmp_path / "gone" / "f.db", root, interval_s=0.05)
        _until(lambda: rec.failures >= 3)
        rec.close()
    assert rec.failures >= 3  # several rounds failed ...
    assert len([r for r in caplog.records if "could not record" in r.getMessage()]) == 1  # ... one line said so


def test_recorder_records_once_the_store_is_back(tmp_path):
    root = _root(tmp_path)
    where = tmp_path / "later"
    rec = FleetRecorder(where / "f.db", root, interval_s=0.05)
    _until(lambda: rec.failures >= 1)
    assert rec.recorded == 0
    where.mkdir()
    deadline = time.time() + 10
    while rec.recorded == 0 and time.time() < deadline:
        time.sleep(0.05)
    rec.close()
    assert rec.recorded == 1


def test_recorder_with_a_locked_store_retries(tmp_path):
    root = _root(tmp_path)
    path = tmp_path / "f.db"
    FleetStore.open(path).close()
    holder = sqlite3.connect(str(path), isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another process's writer holding the lock
    rec = FleetRecorder(path, root, interval_s=0.05)
    rec.nudge()
    deadline = time.time() + 15
    while rec.failures == 0 and time.time() < deadline:
        time.sleep(0.05)
    failed_while_locked = rec.failures
    holder.execute("ROLLBACK")
    holder.close()
    while rec.recorded == 0 and time.time() < deadline + 15:
        time.sleep(0.05)
    rec.close()
    assert (failed_while_locked > 0, rec.recorded) == (True, 1)


def test_recorder_with_an_unwritable_store_never_raises(tmp_path):
    """A store on a filesystem remounted read-only (a real tmpfs): every round fails, none raises."""
    import subprocess

    from tests.conftest import tmpfs

    root = _root(tmp_path)
    with tmpfs("1M") as d:
        FleetStore.open(d / "f.db").close()
        subprocess.run(["mount", "-o", "remount,ro", str(d)], check=True)
        rec = FleetRecorder(d / "f.db", root, interval_s=0.05)
        _until(lambda: rec.failures >= 2)
        rec.close()
    assert rec.failures >= 2 and rec.recorded == 0


# ---- the commands ---------------------------------------------------------------------------------------------


def test_fleet_import_then_suspects_json(tmp_path):
    a, b = _root(tmp_path, "a"), _root(tmp_path, "b", host="node-b", kinds=(("hang", 0),))
    store = tmp_path / "f.db"
    run_cli("fleet", "import", a, b, "--fleet", store, check_rc=0)
    rc, out, _ = run_cli("suspects", "--json", env={"SCOUT_CKPT_FLEET": str(store)}, check_rc=0)
    got = json.loads(out)["suspects"]
    assert [(s["device"], s["class"], s["jobs"]) for s in got] == [
        ("node-a:cpu1", "persistent", ["job-a"]),
        ("node-b:cpu0", "transient", ["job-b"]),
    ]


def test_suspects_json_has_the_contract_keys(tmp_path):
    store = tmp_path / "f.db"
    run_cli("fleet", "import", _root(tmp_path), "--fleet", store, check_rc=0)
    _, out, _ = run_cli("suspects", "--json", "--fleet", store, check_rc=0)
    assert set(json.loads(out)["suspects"][0]) >= {
        "host",
        "local_rank",
        "device",
        "class",
        "jobs",
        "verdicts",
        "score",
        "first_seen",
        "last_seen",
    }


def test_explain_lists_root_and_step(tmp_path):
    root, store = _root(tmp_path), tmp_path / "f.db"
    run_cli("fleet", "import", root, "--fleet", store, check_rc=0)
    _, out, _ = run_cli("suspects", "--explain", "node-a:cpu1", "--json", "--fleet", store, check_rc=0)
    assert [(v["root"], v["step"]) for v in json.loads(out)["verdicts"]] == [(str(root.resolve()), 4)]


def test_explain_of_an_unknown_device_exits_1(tmp_path):
    store = tmp_path / "f.db"
    run_cli("fleet", "import", _root(tmp_path), "--fleet", store, check_rc=0)
    assert run_cli("suspects", "--explain", "GPU-none", "--fleet", store)[0] == 1


def test_format_slurm_from_the_command_parses_back(tmp_path):
    store = tmp_path / "f.db"
    run_cli("fleet", "import", _root(tmp_path), "--fleet", store, check_rc=0)
    _, out, _ = run_cli("suspects", "--format", "slurm", "--fleet", store, check_rc=0)
    (line,) = out.splitlines()
    fields = dict(w.split("=", 1) for w in shlex.split(line)[2:])
    assert (fields["NodeName"], fields["State"]) == ("node-a", "DRAIN")


def _store_with_one(tmp_path) -> Path:
    store = tmp_path / "f.db"
    run_cli("fleet", "import", _root(tmp_path), "--fleet", store, check_rc=0)
    return store


BAD_SUSPECTS = [
    ("--since", "yesterday-ish"),
    ("--min-score", "-1"),
    ("--min-score", "nan"),
    ("--format", "pbs"),
    ("--format", "slurm", "--json"),
    ("--explain", " "),
    ("--bogus",),
]


@pytest.mark.parametrize("args", BAD_SUSPECTS, ids=[" ".join(a) for a in BAD_SUSPECTS])
def test_suspects_bad_input_exits_2_one_line(tmp_path, args):
    store = _store_with_one(tmp_path)
    before = store.read_bytes()
    rc, out, err = run_cli("suspects", *args, "--fleet", store)
    assert (rc, len(err.strip().splitlines()), "Traceback" in err, store.read_bytes() == before) == (
        2,
        1,
        False,
        True,
    ), err


def test_suspects_without_a_store_exits_2(tmp_path):
    rc, _, err = run_cli("suspects", env={"SCOUT_CKPT_FLEET": ""})
    assert (rc, len(err.strip().splitlines())) == (2, 1)


def test_suspects_with_a_missing_store_exits_2_and_creates_nothing(tmp_path):
    rc, _, err = run_cli("suspects", "--fleet", tmp_path / "none.db")
    assert (rc, len(err.strip().splitlines()), (tmp_path / "none.db").exists()) == (2, 1, False)


def test_suspects_on_a_file_that_is_not_a_store_exits_2(tmp_path):
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not sqlite at all" * 10)
    rc, _, err = run_cli("suspects", "--fleet", junk)
    assert (rc, len(err.strip().splitlines()), junk.read_bytes()) == (2, 1, b"not sqlite at all" * 10)


def test_fleet_import_of_a_foreign_directory_writes_nothing(tmp_path):
    good, foreign, store = _root(tmp_path), tmp_path / "foreign", tmp_path / "f.db"
    foreign.mkdir()
    rc, _, err = run_cli("fleet", "import", good, foreign, "--fleet", store)
    assert (rc, len(err.strip().splitlines()), store.exists()) == (2, 1, False)


def test_fleet_import_of_a_missing_root_exits_2(tmp_path):
    rc, _, err = run_cli("fleet", "import", tmp_path / "nope", "--fleet", tmp_path / "f.db")
    assert (rc, len(err.strip().splitlines())) == (2, 1)


def test_fleet_import_without_a_root_exits_2(tmp_path):
    rc, _, err = run_cli("fleet", "import", "--fleet", tmp_path / "f.db")
    assert (rc, len(err.strip().splitlines())) == (2, 1)


def test_an_event_naming_a_rank_records_its_device(tmp_path):
    root = _root(tmp_path)
    with Ledger.open(root, readonly=True) as led:
        (e,) = led.events(("sdc",))
    assert e["detail"]["devices"]["1"]["device"] == "node-a:cpu1"


def test_a_run_without_device_identity_is_named_by_host_and_local_rank():
    from scout_ckpt.fleet.records import from_events

    events = [{"id": 7, "kind": "hang", "ranks": [3], "run_id": "r", "step": 9, "time": 1.0, "detail": {}}]
    (rec,) = from_events("/ckpt/a", events, {("r", 3): {"host": "old-host", "local_rank": 1, "device": None}})
    assert (rec["device"], rec["job"], rec["source"]) == ("old-host:cpu1", "/ckpt/a", "observer")


def test_events_that_name_no_rank_or_no_hardware_kind_are_not_fleet_records():
    from scout_ckpt.fleet.records import from_events

    events = [
        {"id": 1, "kind": "hang", "ranks": [], "run_id": "r", "detail": {}},
        {"id": 2, "kind": "quarantine", "ranks": [0], "run_id": "r", "detail": {}},
    ]
    assert from_events("/ckpt/a", events, {}) == []


def _row(status, ranks, pairs=None):
    detail = {"ring": {"failed_pairs": pairs}} if pairs is not None else {}
    return {"status": status, "ranks": ranks, "recipe": "block", "target": "layers.1", "detail": detail}


def test_triage_runs_an_attributed_rows_ranks():
    from scout_ckpt.replay.triage import suspects as triaged

    assert triaged(_row("ATTRIBUTED", [2])) == [2]


def test_triage_runs_the_disputed_rank_when_every_ring_pair_disagrees():
    from scout_ckpt.replay.triage import suspects as triaged

    assert triaged(_row("INCONCLUSIVE", [], [[2, 0, "output"], [0, 1, "output"], [1, 2, "output"]])) == [2]


def test_triage_leaves_two_ranks_accusing_each_other():
    from scout_ckpt.replay.triage import suspects as triaged

    assert triaged(_row("INCONCLUSIVE", [], [[1, 0, "output"], [0, 1, "output"]])) == []


def test_an_inconclusive_event_is_recorded_for_the_rank_triage_ran():
    from scout_ckpt.fleet.records import from_events

    detail = {"source": "replay", "triage": {"class": "not_hardware", "ranks": {"2": {"class": "not_hardware"}}}}
    events = [{"id": 1, "kind": "sdc", "ranks": [], "run_id": "r", "step": 4, "time": 1.0, "detail": detail}]
    (rec,) = from_events("/ckpt/a", events, {("r", 2): {"host": "h", "local_rank": 2, "device": None}})
    assert (rec["rank"], rec["class"], rec["device"]) == (2, "not_hardware", None)


# ---- bench/campaign_fleet.py: the seeded placements and their scores (pure) -----------------------------------


def _campaign_fleet():
    import importlib.util

    from tests.conftest import REPO

    spec = importlib.util.spec_from_file_location("campaign_fleet", REPO / "bench" / "campaign_fleet.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_fleet_campaign_places_the_bad_device_in_two_jobs_and_flaky_ones_elsewhere():
    cf = _campaign_fleet()
    jobs = cf.plan(3, seed=7)
    bad = [(p["host"], p["local_rank"]) for p in jobs if p["fault"] == "persistent"]
    flaky = [(p["host"], p["local_rank"]) for p in jobs if p["fault"] == "transient"]
    assert (len(bad), len(set(bad)), len(flaky), set(flaky) & set(bad)) == (2, 1, 1, set())


def test_fleet_campaign_plan_is_the_seeds():
    cf = _campaign_fleet()
    assert cf.plan(6, seed=3) == cf.plan(6, seed=3)


def test_fleet_campaign_scores_a_perfect_answer_one():
    cf = _campaign_fleet()
    jobs = [
        {"job": "j1", "fault": "persistent", "host": "node-a", "local_rank": 1},
        {"job": "j2", "fault": "persistent", "host": "node-a", "local_rank": 1},
        {"job": "j3", "fault": "transient", "host": "node-b", "local_rank": 0},
    ]
    answer = [
        {"host": "node-a", "local_rank": 1, "class": "persistent", "jobs": ["j1", "j2"]},
        {"host": "node-b", "local_rank": 0, "class": "transient", "jobs": ["j3"]},
    ]
    got = cf.score(jobs, answer, [])
    assert (got["drain_precision"], got["drain_recall"], got["listed_precision"], got["listed_recall"]) == (1, 1, 1, 1)
    assert (got["class_accuracy"], got["healthy_listed"]) == (1, 0)


def test_fleet_campaign_counts_a_listed_healthy_device_against_precision():
    cf = _campaign_fleet()
    jobs = [{"job": "j1", "fault": "persistent", "host": "node-a", "local_rank": 1}]
    answer = [
        {"host": "node-a", "local_rank": 1, "class": "persistent", "jobs": ["j1"]},
        {"host": "node-b", "local_rank": 1, "class": "persistent", "jobs": ["j1"]},
    ]
    got = cf.score(jobs, answer, [])
    assert (got["drain_precision"], got["drain_recall"], got["healthy_listed"]) == (0.5, 1, 1)


def test_fleet_campaign_counts_a_device_blamed_for_the_data_job():
    cf = _campaign_fleet()
    jobs = [{"job": "jn", "fault": "numerics", "host": "", "local_rank": 0}]
    answer = [{"host": "node-a", "local_rank": 0, "class": "transient", "jobs": ["jn"]}]
    got = cf.score(jobs, answer, [{"job": "jn"}])
    assert (got["not_hardware_blamed"], got["not_hardware_verdicts"], got["listed_precision"]) == (1, 1, 0)
