"""Attribution of a fault from the observers' status table: pure functions, no I/O (see daemon.py for the
rules in words). Kept apart so the rule can be tested on hand-made tables and reused by aftermath.py.

A table is {key: row}. On one host a key is a rank and a row one rank's status. The hierarchy's root
(observer/hierarchy.py) passes grouped rows instead: one row stands for every rank whose status says the same
thing (`n` ranks, listed in `ranks`), so that a judge over 100,000 ranks counts a few hundred rows, not 100,000.
Every count below is a sum of `n` and every named rank comes from `ranks`, so a grouped table gives the verdict
its per-rank expansion gives: the strict majority keeps its meaning."""

from __future__ import annotations

from collections import Counter

ABORT_KINDS = ("hang", "desync", "crash")
INCIDENT_KINDS = ABORT_KINDS


def prog(row: dict) -> tuple[int, int, int]:
    """How far a rank got: its step, its native collective count (every collective issued on the watched
    groups, observer/counts.py; 0 where it is not counted), its traced Python-level collective number."""
    return (row["step"], max(row.get("cseq") or 0, row.get("pos") or 0), row["seq"])


def weight(rows: dict[int, dict], keys) -> int:
    """How many ranks the rows `keys` stand for."""
    return sum(rows[k].get("n", 1) for k in keys)


def members(rows: dict[int, dict], keys) -> list[int]:
    """The ranks the rows `keys` stand for, sorted."""
    return sorted(r for k in keys for r in rows[k].get("ranks", (k,)))


def label(rows: dict[int, dict], k: int) -> str:
    """'rank 3', or 'ranks 0-7' for a grouped row."""
    ranks = rows[k].get("ranks", (k,))
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {spans(ranks)}"


def spans(ranks) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out: list[str] = []
    rs = sorted(ranks)
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(out)


def attribute(rows: dict[int, dict], world_size: int, stall_s: float, order_gap_s: float = 0.05) -> dict | None:
    """The verdict on a table of observer statuses ({rank: row}, ages already brought up to date), or None.

    Returns {"kind", "ranks", "step", "seq", "attribution", "reason"}; `ranks` is empty when a fault is seen but
    no strict majority points at anyone."""
    majority = world_size // 2 + 1
    # Ranks that entered the same collective number with different fingerprints: a desync, whatever else
    # followed (a mismatched collective may fail and take its ranks down, or hang). In SPMD training equal
    # numbers mean the same collective, so no stall is needed to be sure.
    desync = fingerprint_mismatch(rows, majority) or position_mismatch(rows, majority)
    if desync:
        return desync
    gone = sorted(k for k, row in rows.items() if row["state"] == "gone")
    culprits = [k for k in gone if not row_error(rows[k])]
    if culprits:
        named = members(rows, culprits)
        if world_size == 1:  # a 1-rank job: no peer to outvote, and no peer whose failure could have killed it
            return {
                "kind": "crash",
                "ranks": named,
                "step": rows[culprits[0]]["step"],
                "seq": rows[culprits[0]]["seq"],
                "attribution": "only_rank",
                "reason": "the trainer process of the job's only rank is gone without a clean close",
            }
        if world_size - weight(rows, culprits) >= majority:
            last = min(culprits, key=lambda k: prog(rows[k]))
            return {
                "kind": "crash",
                "ranks": named,
                "step": rows[last]["step"],
                "seq": rows[last]["seq"],
                "attribution": "strict_majority",
                "reason": f"trainer process of rank(s) {named} is gone without a clean close "
                f"({weight(rows, gone) - weight(rows, culprits)} other(s) died after a collective failed)",
            }
        first = first_gone(rows, culprits, order_gap_s)
        if first and world_size - weight(rows, first) >= majority:
            last = min(first, key=lambda k: prog(rows[k]))
            named = members(rows, first)
            return {
                "kind": "crash",
                "ranks": named,
                "step": rows[last]["step"],
                "seq": rows[last]["seq"],
                "attribution": "first_gone",
                "reason": f"trainer process of rank(s) {named} died first, >= {order_gap_s:g}s before any "
                f"other rank (the others were torn down after it, e.g. by torchrun)",
            }
        return None
    live = {k: row for k, row in rows.items() if row["state"] in ("running", "stopped")}
    stalled = [k for k, row in live.items() if row["age_s"] >= stall_s]
    stopped = sorted(k for k in stalled if live[k]["state"] == "stopped")
    waiting = [k for k in stalled if live[k]["state"] == "running" and (live[k]["in_coll"] or live[k].get("in_side"))]
    # stalled and busy: waiting in a collective we see, or inside a step (e.g. in DDP's C++ all-reduce)
    busy = [
        k for k in stalled if live[k]["state"] == "running" and (k in waiting or live[k].get("phase", "idle") != "idle")
    ]
    counts: Counter = Counter()
    for k in busy:
        counts[prog(live[k])] += live[k].get("n", 1)
    point, n = counts.most_common(1)[0] if counts else (None, 0)
    if n >= majority and point is not None:  # point is None only when no rank is busy (n == 0)
        step, cseq, seq = point
        ahead = members(live, (k for k in waiting if prog(live[k]) > point and live[k]["in_coll"]))
        if ahead:
            return {
                "kind": "desync",
                "ranks": ahead,
                "step": step,
                "seq": seq,
                "cseq": cseq,
                "attribution": "strict_majority",
                "reason": f"the majority waits in collective #{seq} at step {step}; rank(s) {ahead} "
                f"wait in a later collective",
            }
        behind = sorted(k for k in live if prog(live[k]) < point)
        ranks = members(live, set(behind) | set(stopped))
        in_training_coll = weight(live, (k for k in busy if prog(live[k]) == point and live[k]["in_coll"]))
        if ranks or in_training_coll >= majority:
            at = f"native collective #{cseq}" if cseq else f"collective #{seq}"
            reason = f"{n} of {world_size} ranks are stuck at {at}, step {step}, for >= {stall_s:g}s; " + (
                f"rank(s) {ranks} never got there ("
                + ", ".join(f"{label(live, k)} at {_at(live[k])}" for k in behind)
                + ")"
                if behind
                else f"rank(s) {ranks} are stopped"
                if ranks
                else "every rank is inside it (no laggard)"
            )
            return {
                "kind": "hang",
                "ranks": ranks,
                "step": step,
                "seq": seq,
                "cseq": cseq,
                "attribution": "strict_majority" if ranks else "none",
                "reason": reason,
            }
        # equal progress, no laggard, and not a training collective (a long save, an eval): no verdict
    if stopped:
        r0 = stopped[0]
        named = members(live, stopped)
        return {
            "kind": "hang",
            "ranks": named,
            "step": live[r0]["step"],
            "seq": live[r0]["seq"],
            "attribution": "stopped",
            "reason": f"trainer process of rank(s) {named} is stopped (SIGSTOP) for >= {stall_s:g}s",
        }
    if n < majority:
        seq_verdict = sequence_hang(live, world_size, stall_s)
        if seq_verdict:
            return seq_verdict
    if n < majority and weight(live, waiting) >= majority:
        return {
            "kind": "hang",
            "ranks": [],
            "step": max(live[k]["step"] for k in waiting),
            "seq": max(live[k]["seq"] for k in waiting),
            "attribution": "inconclusive",
            "reason": "a majority waits in collectives, but at different points: no strict majority",
            "where": where(live),
        }
    if n < majority and waiting and weight(live, live) == world_size and set(busy) == set(live):
        # Every rank stuck, one of them inside a collective, and no point holds a majority (two ranks, or two
        # against two): the job is hung, but nobody can be blamed. Say so and say where each rank is, rather
        # than wait for the process-group timeout.
        return {
            "kind": "hang",
            "ranks": [],
            "step": max(live[k]["step"] for k in waiting),
            "seq": max(live[k]["seq"] for k in waiting),
            "attribution": "inconclusive",
            "reason": f"every rank has been stuck for >= {stall_s:g}s at different points and no strict "
            f"majority agrees on one: " + "; ".join(f"{label(live, k)} {w}" for k, w in _where_by_key(live)),
            "where": where(live),
        }
    return None


def _count(row: dict) -> int:
    return max(row.get("cseq") or 0, row.get("pos") or 0)


def sequence_hang(live: dict[int, dict], world_size: int, stall_s: float) -> dict | None:
    """A hang without a strict majority at one point (2 ranks, or 2 against 2), from the collective sequence.

    Every rank is running and stalled for stall_s, at different points, and at least one of them waits: inside
    a traced collective, a side-group one, or in a native collective the others never issued (its count is
    ahead of theirs: it cannot have completed it, a collective needs every rank). The ranks at the furthest
    point wait for the others; when each of those waits and every rank behind sits outside any collective (its
    Python progress stopped on its own: a hang before forward, in backward, in the optimizer), the ranks behind
    are the hung ones ("sequence" attribution). Otherwise the job is hung but nobody can be blamed: an
    unattributed hang that says where each rank is. Either way action="abort" ends the generation instead of
    leaving it to the process-group timeout."""
    if weight(live, live) != world_size or world_size < 2:
        return None
    if any(row["age_s"] < stall_s or row["state"] != "running" for row in live.values()):
        return None
    points = {r: prog(row) for r, row in live.items()}
    if len(set(points.values())) < 2:
        return None
    low = min(_count(row) for row in live.values())

    def waits(row: dict) -> bool:
        return bool(row.get("in_coll") or row.get("in_side")) or _count(row) > low

    if not any(waits(row) for row in live.values()):
        return None  # nobody waits for anybody: every rank busy on its own (not a hang we can tell)
    top = max(points.values())
    ahead = sorted(k for k in live if points[k] == top)
    behind = sorted(k for k in live if points[k] < top)
    if any(live[r].get("phase") == "checkpoint" for r in behind):
        # The ranks behind are saving or loading (a coordinator's ledger writes after a load can outlast stall_s
        # while its peer already waits in training): a slow checkpoint, not a hang the sequence can tell. A rank
        # truly stuck there is ended by the process-group timeout; with 3+ ranks the majority rule still judges.
        return None
    step = live[ahead[0]]["step"]
    seq, cseq = live[ahead[0]]["seq"], _count(live[ahead[0]])
    if all(waits(live[r]) for r in ahead) and all(
        not live[r].get("in_coll") and not live[r].get("in_side") and _count(live[r]) <= cseq for r in behind
    ):
        return {
            "kind": "hang",
            "ranks": members(live, behind),
            "step": step,
            "seq": seq,
            "cseq": cseq,
            "attribution": "sequence",
            "reason": f"rank(s) {members(live, ahead)} wait at step {step} (collective #{seq}, native collective "
            f"#{cseq}) for >= {stall_s:g}s; rank(s) {members(live, behind)} never got there and stopped outside "
            f"any collective (" + ", ".join(f"{label(live, k)} at {_at(live[k])}" for k in behind) + ")",
            "where": where(live),
        }
    return {
        "kind": "hang",
        "ranks": [],
        "step": step,
        "seq": seq,
        "cseq": cseq,
        "attribution": "inconclusive",
        "reason": f"every rank has been stuck for >= {stall_s:g}s at different points and the collective "
        f"sequence does not single anyone out: " + "; ".join(f"{label(live, k)} {w}" for k, w in _where_by_key(live)),
        "where": where(live),
    }


def _at(row: dict) -> str:
    return f"step {row['step']}, native collective #{max(row.get('cseq') or 0, row.get('pos') or 0)}"


def _where_by_key(live: dict[int, dict]) -> list[tuple[int, str]]:
    out = []
    for k, row in sorted(live.items()):
        at = f"step {row['step']}, "
        if row.get("in_coll"):
            text = at + f"waiting in collective #{row['seq']}"
        elif row.get("in_side"):
            text = at + "waiting in a side-group collective"
        else:
            text = at + f"in phase {row.get('phase', '?')} after collective #{row['seq']}"
        if row.get("cseq"):
            text += f" (native collectives issued: {row['cseq']})"
        out.append((k, text))
    return out


def where(live: dict[int, dict]) -> dict:
    """Where each rank is, in words (for verdicts that cannot name a culprit): {rank: text}; a grouped row
    gives one entry keyed by the span of its ranks ('0-7')."""
    out: dict = {}
    for k, text in _where_by_key(live):
        ranks = live[k].get("ranks", (k,))
        out[ranks[0] if len(ranks) == 1 else spans(ranks)] = text
    return out


def position_mismatch(rows: dict[int, dict], majority: int) -> dict | None:
    """A Python-level collective at native position P on some ranks, and something else at P on others: a
    different Python collective (another fingerprint), or a native one (the rank's count passed P, and its
    latest traced collective is before P: it issued P from C++, e.g. DDP's reducer). In SPMD training every rank
    issues the same collectives in the same order on the watched groups, so one position holds one collective.
    A rank that has not reached P, or whose latest traced collective is after P, says nothing about P; nor does
    one whose latest traced collective at P was followed by one off the watched groups (`off_watch`: its
    fingerprint is that later one's, e.g. FSDP2 ranks inside a save's gather while a peer hangs in its optimizer
    step)."""
    positions = sorted({row["pos"] for row in rows.values() if row.get("pos")})
    for p in positions:
        view = {}
        for r, row in rows.items():
            pos, count = row.get("pos") or 0, max(row.get("cseq") or 0, row.get("pos") or 0)
            if pos == p:
                if not row.get("off_watch"):
                    view[r] = row["fp"]
            elif pos < p <= count:
                view[r] = "native"
        kinds: Counter = Counter()
        for r, v in view.items():
            kinds[v] += rows[r].get("n", 1)
        if len(kinds) < 2:
            continue
        value, count = kinds.most_common(1)[0]
        odd = members(rows, (r for r, v in view.items() if v != value))
        attributed = count >= majority
        python = sorted(r for r, v in view.items() if v != "native")
        step = min(rows[r]["step"] for r in view)
        return {
            "kind": "desync",
            "ranks": odd if attributed else [],
            "step": step,
            "seq": max(rows[r]["seq"] for r in python),
            "cseq": p,
            "attribution": "strict_majority" if attributed else "inconclusive",
            "reason": f"native collective #{p}: rank(s) {members(rows, python)} issued a Python-level collective "
            f"there, rank(s) {members(rows, set(view) - set(python))} another one"
            + ("" if attributed else f"; no strict majority (suspects {odd})"),
        }
    return None


def fingerprint_mismatch(live: dict[int, dict], majority: int) -> dict | None:
    """Ranks that entered the same collective number with different fingerprints: a desync."""
    by_seq: dict[int, list[int]] = {}
    for r, row in live.items():
        if row["seq"] > 0:
            by_seq.setdefault(row["seq"], []).append(r)
    for seq, ranks in sorted(by_seq.items()):
        fps: Counter = Counter()
        for r in ranks:
            fps[live[r]["fp"]] += live[r].get("n", 1)
        if len(fps) < 2:
            continue
        fp, count = fps.most_common(1)[0]
        odd = members(live, (r for r in ranks if live[r]["fp"] != fp))
        attributed = count >= majority
        step = min(live[r]["step"] for r in ranks)
        return {
            "kind": "desync",
            "ranks": odd if attributed else [],
            "step": step,
            "seq": seq,
            "attribution": "strict_majority" if attributed else "inconclusive",
            "reason": f"collective #{seq}: ranks entered collectives with {len(fps)} different fingerprints"
            + ("" if attributed else f"; no strict majority (suspects {odd})"),
        }
    return None


def first_gone(rows: dict[int, dict], candidates: list[int], gap_s: float) -> list[int]:
    """The rows (keys) among `candidates` that died first, separated by at least `gap_s` from the next death (each
    observer stamps its trainer's death: `gone_at`, wall time, from PR_SET_PDEATHSIG where it has it); [] when
    the order is not clear (a job-wide kill takes every rank within milliseconds)."""
    times = sorted((rows[r]["gone_at"], r) for r in candidates if rows[r].get("gone_at") is not None)
    if len(times) < len(candidates) or len(times) < 2:
        return []
    for i in range(1, len(times)):
        if times[i][0] - times[i - 1][0] >= gap_s:
            return sorted(r for _t, r in times[:i])
    return []


def row_error(row: dict) -> bool:
    return bool(row.get("error"))


def incident_key(v: dict) -> str:
    ranks = "-".join(str(r) for r in v["ranks"]) or "none"
    return f"{v['kind']}-s{v['step']}-q{v['seq']}-r{ranks}"
