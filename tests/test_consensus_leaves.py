"""Non-tensor leaves compared canonically (consensus/flatten.py): a set's iteration order, a dict's insertion
order and a process's hash seed never make equal values differ; a value that has no canonical encoding is left
out of consensus with a reason, never compared by its repr."""

from __future__ import annotations

import json
import math
import os
import struct

import pytest
import torch

from scout_ckpt.ledger import Ledger
from tests.conftest import run_cli


def test_a_set_in_the_state_is_no_sdc(tmp_path):
    """3 real gloo ranks, each a fresh interpreter (spawn: its own hash seed) holding the same set of 50 strings
    iterated in another order: the save is certified, no sdc event names a healthy rank, and loading it back in
    fresh processes passes load verification (the set's signature recorded at the save matches). An object that
    has no canonical encoding (its repr shows a set) is left out of consensus, named in the evidence."""
    from scout_ckpt.testing.launch import run_ranks
    from tests import workers_leaves as W

    out = run_ranks(W.save_with_a_set, 3, str(tmp_path), timeout=240, start_method="spawn")
    orders = [o.result["order"] for o in out]
    assert all(sorted(o) == sorted(W.TAGS) for o in orders)
    assert len({tuple(o) for o in orders}) > 1, "the ranks' sets iterate alike: the test proves nothing"
    if "PYTHONHASHSEED" not in os.environ:
        assert len({o.result["hash_of_tag"] for o in out}) > 1  # and their hash seeds differ
    for o in out:
        assert o.result["plain"]["state"] == "certified", o.result["plain"]
        assert o.result["verdict"]["state"] == "certified", o.result["verdict"]
        assert o.result["loaded"] == 2 and o.result["tags_loaded"], o.result
    with Ledger.open(tmp_path, readonly=True) as led:
        assert led.events(("sdc",)) == [] and led.events(("load_mismatch",)) == []
        assert led.checkpoint(1)["state"] == led.checkpoint(2)["state"] == "certified"
        first = led.evidence(1)["consensus"]
        assert first["status"] == "pass" and first["n_not_comparable"] == 0, first
        ev = led.evidence(2)["consensus"]
        assert ev["status"] == "pass", ev
        assert ev["n_not_comparable"] == 1 and [n["key"] for n in ev["not_comparable"]] == ["meta.holder"], ev
        assert "Holder has no canonical encoding" in ev["not_comparable"][0]["why"], ev
    # certify re-reads the step holding the set offline (the entry reader admits a set of scalars) and agrees; a
    # frozenset or the Holder it cannot read offline (torch.load's weights_only refuses them)
    rc, stdout, stderr = run_cli("certify", tmp_path, "--step", 1, "--json")
    assert rc == 0 and json.loads(stdout)["results"][0]["state"] == "certified", (rc, stdout, stderr)


# ---- the encoding itself (no processes) ----------------------------------------------------------------------


def test_a_sets_order_and_a_dicts_insertion_order_do_not_change_the_encoding():
    import random

    from scout_ckpt.consensus.flatten import leaf_bytes

    words = [f"w{i}" * (i % 5 + 1) for i in range(40)]
    sets = []
    for seed in range(20):
        order = list(words)
        random.Random(seed).shuffle(order)
        sets.append(set(order))
    assert len({tuple(s) for s in sets}) > 1  # the sets really iterate in different orders
    assert len({leaf_bytes(s) for s in sets}) == 1
    assert len({leaf_bytes(frozenset(s)) for s in sets}) == 1
    assert leaf_bytes(set(words)) != leaf_bytes(frozenset(words))  # the type is part of the value
    assert leaf_bytes(set(words)) != leaf_bytes(set(words[1:]))
    a = {"x": 1, "y": [2, 3], 4: {"z"}}
    b = {4: {"z"}, "y": [2, 3], "x": 1}
    assert list(a) != list(b) and leaf_bytes(a) == leaf_bytes(b)
    assert leaf_bytes(a) != leaf_bytes({"x": 1, "y": [3, 2], 4: {"z"}})


def test_floats_compare_by_their_bits():
    from scout_ckpt.consensus.flatten import leaf_bytes

    nan = float("nan")
    other_nan = struct.unpack(">d", bytes.fromhex("7ff8000000000001"))[0]
    neg_nan = struct.unpack(">d", bytes.fromhex("fff8000000000000"))[0]
    assert math.isnan(other_nan) and math.isnan(neg_nan)
    assert leaf_bytes(0.0) != leaf_bytes(-0.0)
    assert leaf_bytes(nan) == leaf_bytes(float("nan"))  # a NaN equals itself (nan != nan as a float)
    assert len({leaf_bytes(nan), leaf_bytes(other_nan), leaf_bytes(neg_nan)}) == 3  # other bits: other values
    assert leaf_bytes(0.1) != leaf_bytes(math.nextafter(0.1, 1.0))
    assert leaf_bytes({0.0}) != leaf_bytes({-0.0}) and leaf_bytes((nan,)) == leaf_bytes((float("nan"),))
    assert leaf_bytes(float("inf")) != leaf_bytes(float("-inf"))


def test_scalars_keep_the_encoding_older_manifests_recorded():
    """Load verification compares with signatures recorded at save, possibly by an older scout-ckpt: the
    encodings of scalars and other values that were already canonical are unchanged (type name, then JSON)."""
    from scout_ckpt.consensus.flatten import leaf_bytes

    assert leaf_bytes(3) == b"builtins.int:3"
    assert leaf_bytes(True) == b"builtins.bool:true"
    assert leaf_bytes(None) == b"builtins.NoneType:null"
    assert leaf_bytes(0.1) == b"builtins.float:0.1" and leaf_bytes(-0.0) == b"builtins.float:-0.0"
    assert leaf_bytes("é") == b'builtins.str:"\\u00e9"'
    assert leaf_bytes(b"\x00ab") == b"builtins.bytes:\x00ab"
    assert leaf_bytes(torch.float32) == b"torch.dtype:torch.float32"


def test_containers_are_compared_in_order_and_framed():
    from scout_ckpt.consensus.flatten import leaf_bytes

    assert leaf_bytes((1, 2)) != leaf_bytes((2, 1))
    assert leaf_bytes((1, 2)) != leaf_bytes([1, 2])
    assert leaf_bytes(("ab", "c")) != leaf_bytes(("a", "bc"))  # each element length-prefixed
    assert leaf_bytes((b"ab", b"c")) != leaf_bytes((b"a", b"bc"))
    assert leaf_bytes(1) != leaf_bytes(1.0) != leaf_bytes(True)
    assert leaf_bytes("a") != leaf_bytes(b"a")
    assert leaf_bytes({(1, "a"), (2, "b")}) == leaf_bytes({(2, "b"), (1, "a")})


class _Opaque:
    def __init__(self):
        self.items = {"a", "b"}


def test_what_has_no_canonical_encoding_is_not_comparable():
    import datetime

    import numpy as np

    from scout_ckpt.consensus.canonical import NotComparable, NotComparableError, leaf_bytes
    from scout_ckpt.consensus.flatten import flatten_state
    from scout_ckpt.consensus.mesh import full_signable

    class Tz(datetime.tzinfo):
        def utcoffset(self, dt):
            return datetime.timedelta(0)

    for value in (
        object(),
        _Opaque(),
        lambda: 1,
        np.array([{"a"}], dtype=object),
        {_Opaque()},
        (1, object()),
        datetime.datetime(2020, 1, 1, tzinfo=Tz()),
    ):
        with pytest.raises(NotComparableError):
            leaf_bytes(value)
    deep: tuple = ()
    for _ in range(100):
        deep = (deep,)
    with pytest.raises(NotComparableError):
        leaf_bytes(deep)
    flat = flatten_state({"step": 3, "obj": _Opaque(), "t": torch.zeros(2)})
    assert isinstance(flat["obj"], NotComparable) and "_Opaque has no canonical encoding" in flat["obj"].why
    assert flat["step"] == leaf_bytes(3)
    assert full_signable(flat)[1] == ["obj"]  # load verification leaves it unsigned
    # still comparable: values whose repr depends on the value alone
    assert leaf_bytes(datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc))
    assert leaf_bytes(slice(1, None, 2)) == b"builtins.slice:slice(1, None, 2)"


def test_full_signatures_leave_out_what_is_not_comparable():
    from scout_ckpt.consensus.full import full_signatures

    sigs = full_signatures({"t": torch.ones(3), "tags": {"b", "a"}, "obj": _Opaque()})
    assert set(sigs) == {"t", "tags"}
    assert sigs["tags"] == full_signatures({"tags": {"a", "b"}})["tags"]


def test_the_offline_entry_reader_admits_a_set_of_scalars_only():
    """certify and adopt open a DCP entry after a dry run of its pickle (format/dcp_pickle.py): a set of strings
    or numbers (torch.save writes `set([...])`, torch.load's weights_only admits it) is read; a set of tuples is
    refused (hashing a deeply nested tuple in the real load would overflow the C stack)."""
    import io

    import numpy as np

    from scout_ckpt.format.dcp_entries import load_entry
    from scout_ckpt.format.dcp_pickle import RefusedPickle
    from scout_ckpt.format.scan_reader import Memory

    def entry(value):
        buf = io.BytesIO()
        torch.save(value, buf)
        blob = buf.getvalue()
        return load_entry(Memory(np.frombuffer(blob, np.uint8)), 0, len(blob))

    assert entry({"a", "b"}) == {"a", "b"} and entry(set()) == set() and entry({1, 2.5, None}) == {1, 2.5, None}
    assert entry({"k": {"x"}}) == {"k": {"x"}}
    with pytest.raises(RefusedPickle):
        entry({(1, 2)})
