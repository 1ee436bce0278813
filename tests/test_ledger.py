import sqlite3

import pytest

from scout_ckpt.errors import LedgerError
from scout_ckpt.format.layout import LEDGER_NAME
from scout_ckpt.ledger import SCHEMA_VERSION, Ledger
from tests.conftest import ledger_write_lock


def _make(root):
    led = Ledger.open(root, create=True)
    led.begin_run("r1", world_size=3, topology={"mode": "ddp"}, policy={"require": ["bytes"]})
    led.record_writing(10, "r1", "a1", "step-00000010")
    return led


def test_create_write_read(tmp_path):
    led = _make(tmp_path)
    led.record_commit(
        10,
        run_id="r1",
        path="step-00000010",
        nbytes=7,
        manifest_digest="m",
        files=[{"path": ".metadata", "size": 7, "digest": "d", "rank": 0}],
        evidence={"bytes": {"status": "pass", "reasons": []}},
        state="certified",
        reasons=[],
        attempt="a1",
    )
    led.add_event("hang", step=10, ranks=[3, 1], detail={"stack": "x"})
    led.close()
    ro = Ledger.open(tmp_path, readonly=True)
    assert ro.latest()["step"] == 10
    assert ro.files(10)[0]["digest"] == "d"
    assert ro.events()[0]["ranks"] == [1, 3]
    assert [(c["state"], c["attempt"], c["outcome"]) for c in ro.certifications(10)] == [
        ("writing", "a1", "applied"),
        ("certified", "a1", "applied"),
    ]
    assert ro.run("r1")["policy"] == {"require": ["bytes"]}
    with pytest.raises(LedgerError):
        ro.transition(10, "rejected", [], source="x", expect="certified")


def test_wal_mode_and_version(tmp_path):
    _make(tmp_path).close()
    conn = sqlite3.connect(tmp_path / LEDGER_NAME)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(SCHEMA_VERSION)


@pytest.mark.parametrize(
    "content,needle",
    [
        (b"this is not a database at all" * 100, "not a readable scout-ckpt ledger"),
        (None, "not a scout-ckpt ledger"),
    ],
)
def test_foreign_files_are_refused_untouched(tmp_path, content, needle):
    path = tmp_path / LEDGER_NAME
    if content is None:
        c = sqlite3.connect(path)
        c.execute("CREATE TABLE other(x)")
        c.commit()
        c.close()
    else:
        path.write_bytes(content)
    before = path.read_bytes()
    for ro in (True, False):
        with pytest.raises(LedgerError, match=needle):
            Ledger.open(tmp_path, readonly=ro)
    assert path.read_bytes() == before


def test_newer_schema_is_refused(tmp_path):
    _make(tmp_path).close()
    c = sqlite3.connect(tmp_path / LEDGER_NAME)
    c.execute("UPDATE meta SET value='99' WHERE key='schema_version'")
    c.commit()
    c.close()
    with pytest.raises(LedgerError, match="newer"):
        Ledger.open(tmp_path)


def test_missing_and_not_a_directory(tmp_path):
    with pytest.raises(LedgerError, match="no such directory"):
        Ledger.open(tmp_path / "nope", readonly=True)
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(LedgerError, match="not a directory"):
        Ledger.open(f, readonly=True)
    with pytest.raises(LedgerError, match="no scout-ckpt ledger"):
        Ledger.open(tmp_path, readonly=True)


def test_locked_writer_times_out_and_readers_still_work(tmp_path, monkeypatch):
    _make(tmp_path).close()
    with ledger_write_lock(tmp_path / LEDGER_NAME, 30):
        monkeypatch.setenv("SCOUT_CKPT_BUSY_TIMEOUT", "0.3")
        ro = Ledger.open(tmp_path, readonly=True)
        assert ro.checkpoint(10)["state"] == "writing"
        led = Ledger.open(tmp_path)
        with pytest.raises(LedgerError, match="locked"):
            led.transition(10, "rejected", [], source="test", expect="writing")
        assert ro.checkpoint(10)["state"] == "writing"


def test_writer_waits_for_a_short_lock(tmp_path, monkeypatch):
    """BEGIN IMMEDIATE + busy timeout: a second writer waits instead of failing at once."""
    _make(tmp_path).close()
    with ledger_write_lock(tmp_path / LEDGER_NAME, 0.5) as holder:
        monkeypatch.setenv("SCOUT_CKPT_BUSY_TIMEOUT", "20")
        led = Ledger.open(tmp_path)
        assert led.transition(10, "rejected", [{"code": "x"}], source="test", expect="writing")
        assert led.checkpoint(10)["state"] == "rejected"
        assert holder.wait() == 0  # the holder ended its transaction and exited normally


def test_events_name_the_node_of_their_ranks(tmp_path):
    """run_ranks (placement.record at start-up) lets every event say where its ranks ran: the host, torchrun's
    node rank (GROUP_RANK) and the local rank, so `report` names the machine of a dead or hung rank."""
    led = _make(tmp_path)
    led.record_ranks(
        "r1",
        [
            {"rank": r, "host": f"h{r // 2}", "node_rank": r // 2, "local_rank": r % 2, "pid": r, "restart_count": 0}
            for r in range(4)
        ],
    )
    led.add_event("crash", step=10, ranks=[3], run_id="r1")
    led.add_event("hang", step=10, ranks=[1], run_id="other-run")  # no places recorded: unchanged
    led.add_event("hang", step=10, ranks=[2], run_id="r1", detail={"nodes": {"2": "told"}})
    ev = led.events()
    assert ev[0]["detail"]["nodes"] == {"3": "h1 node 1 local 1"}
    assert "nodes" not in ev[1]["detail"] and ev[2]["detail"]["nodes"] == {"2": "told"}
    assert [p["node_rank"] for p in led.rank_places("r1")] == [0, 0, 1, 1]
    led.close()
    # a ledger from before run_ranks existed: readers get no places, writers create the table
    c = sqlite3.connect(tmp_path / LEDGER_NAME)
    c.execute("DROP TABLE run_ranks")
    c.commit()
    c.close()
    with Ledger.open(tmp_path, readonly=True) as ro:
        assert ro.rank_places("r1") == []
    with Ledger.open(tmp_path) as rw:
        assert rw.rank_places("r1") == []
        rw.add_event("crash", ranks=[0], run_id="r1")
