from scout_ckpt import policy
from scout_ckpt.policy import evaluate, evidence

FULL = {"require": ["bytes", "invariants", "consensus", "replay"], "allow_not_applicable": []}


def test_all_pass_certifies():
    ev = {k: evidence("pass") for k in FULL["require"]}
    assert evaluate(FULL, ev).state == "certified"


def test_missing_evidence_never_certifies():
    ev = {"bytes": evidence("pass"), "invariants": evidence("pass"), "consensus": evidence("pass")}
    v = evaluate(FULL, ev)
    assert v.state == "committed"
    assert v.reasons == [{"code": "replay_missing", "kind": "replay"}]


def test_failure_rejects_with_reasons():
    ev = {k: evidence("pass") for k in FULL["require"]}
    ev["consensus"] = evidence("fail", [{"code": "consensus_attributed", "ranks": [2]}])
    v = evaluate(FULL, ev)
    assert v.state == "rejected" and v.reasons == [{"code": "consensus_attributed", "ranks": [2]}]


def test_inconclusive_blocks_like_a_failure():
    ev = {k: evidence("pass") for k in FULL["require"]}
    ev["replay"] = evidence("inconclusive", [{"code": "replay_inconclusive", "ranks": [0, 1]}])
    assert evaluate(FULL, ev).state == "rejected"


def test_not_applicable_passes_only_where_allowed():
    ev = {k: evidence("pass") for k in FULL["require"]}
    ev["consensus"] = evidence("not_applicable", [{"code": "no_replicas"}])
    assert evaluate(FULL, ev).state == "committed"
    assert evaluate({**FULL, "allow_not_applicable": ["consensus"]}, ev).state == "certified"


def test_unrequired_failure_still_rejects():
    ev = {
        "bytes": evidence("pass"),
        "invariants": evidence("pass"),
        "replay": evidence("fail", [{"code": "replay_sdc", "ranks": [1]}]),
    }
    assert evaluate(policy.FOUNDATION, ev).state == "rejected"


def test_coverage_reasons_are_kept_when_pending():
    ev = {k: evidence("pass") for k in FULL["require"]}
    ev["replay"] = evidence("missing", [{"code": "replay_coverage_incomplete", "missing": ["blocks.1"]}])
    v = evaluate(FULL, ev)
    assert v.state == "committed" and v.reasons[0]["missing"] == ["blocks.1"]
