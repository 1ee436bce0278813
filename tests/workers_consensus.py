"""Rank functions for the consensus tests (module level: run_ranks forks into them). Results are plain data."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from scout_ckpt.consensus.c3 import c3_over_group
from scout_ckpt.consensus.full import full_signatures
from scout_ckpt.consensus.groups import ConsensusGroups
from scout_ckpt.consensus.save_time import save_time_consensus
from scout_ckpt.consensus.signatures import flatten_state, signature_hex, tensor_signature
from scout_ckpt.testing.faults import fault_points


class AppState:
    """The DCP recipe's Stateful wrapper around a model and its optimizer."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}

    def load_state_dict(self, sd):
        self.model.load_state_dict(sd["model"])
        self.optimizer.load_state_dict(sd["optim"])


def flip_bit(t: torch.Tensor, element: int = 0, bit: int = 0) -> None:
    """Flip one bit of one element of t, in place (through its bytes)."""
    raw = t.detach().view(-1).view(torch.uint8)
    byte = element * t.element_size() + bit // 8
    raw[byte] ^= 1 << (bit % 8)


def replicated_state(step: int = 5):
    """Identical on every rank: a small model and its Adam state after one step on the same batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    return {"app": AppState(model, opt), "step": step, "lr": 1e-3, "extra": {"ema": torch.randn(3).to(torch.bfloat16)}}


def ddp_consensus(rank, world, flips=(), extra_key_rank=None, step_rank=None, mode="ddp", mesh_shape=None):
    """save_time_consensus on replicated state; `flips` is [(rank, dotted name)]: that rank flips one bit of that
    tensor; `extra_key_rank` adds a key to its state; `step_rank` saves another step number (a Python int)."""
    state = replicated_state(step=6 if rank == step_rank else 5)
    groups = ConsensusGroups.create(mode, world, mesh_shape, timeout_s=30)
    flat = flatten_state(state)
    for r, name in flips:
        if r == rank:
            t = flat[name]
            flip_bit(t, element=min(1, t.numel() - 1), bit=17 if t.element_size() >= 4 else 3)
    if extra_key_rank == rank:
        state["surprise"] = torch.zeros(2)
    return {
        "evidence": save_time_consensus(state, groups),
        "group_ranks": groups.group_ranks,
        "has_replicas": groups.has_replicas,
        "groups": groups.groups,
    }


def hsdp_consensus(rank, world, flip_rank=None):
    """HSDP 2x2 with DTensors placed (Replicate, Shard(0)): ranks 0,2 and 1,3 hold the same shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    w, b = torch.randn(6, 5), torch.randn(6)
    state = {
        "model": {
            "w": distribute_tensor(w, mesh, [Replicate(), Shard(0)]),
            "b": distribute_tensor(b, mesh, [Replicate(), Shard(0)]),
        },
        "step": 3,
    }
    if rank == flip_rank:
        flip_bit(state["model"]["w"].to_local(), element=2, bit=30)
    groups = ConsensusGroups.create("hsdp", world, (2, 2), timeout_s=30)
    return {
        "evidence": save_time_consensus(state, groups),
        "group_ranks": groups.group_ranks,
        "local_w": signature_hex(tensor_signature(state["model"]["w"].to_local())),
    }


def fsdp_consensus(rank, world, drift_rank=None):
    """Pure FSDP: a single-owner sharded weight, plus plain state every rank holds (one rank's may drift)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    groups = ConsensusGroups.create("fsdp", world, timeout_s=30)
    mesh = init_device_mesh("cpu", (world,))
    w = distribute_tensor(torch.arange(16.0).reshape(8, 2), mesh, [Shard(0)])  # shards differ by design
    lr = torch.tensor([2e-3 if rank == drift_rank else 1e-3])
    state = {"w": w, "lr": lr, "step": 1}
    return {"evidence": save_time_consensus(state, groups), "group": groups.group, "group_ranks": groups.group_ranks}


def c3_direct(rank, world, odd_rank, odd_tensor):
    """c3_over_group on the world gloo group with hand-made signatures: one rank differs on one tensor."""
    groups = ConsensusGroups.create("ddp", world, timeout_s=30)
    sigs = torch.arange(10, dtype=torch.int64).reshape(5, 2)
    if rank == odd_rank:
        sigs[odd_tensor, 1] += 1
    gv = c3_over_group(sigs, groups.group, groups.group_ranks, names=[f"t{i}" for i in range(5)])
    return {**gv.to_dict(), "per_tensor": [[r.status, list(r.attributed)] for r in gv.per_tensor], "status": gv.status}


def _dtensor_cases(t: torch.Tensor):
    """(label, DTensor) of t under many placements, over a 1-D mesh of 4 and a 2x2 mesh, plus redistributions."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh4 = init_device_mesh("cpu", (4,))
    mesh22 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    d4 = distribute_tensor(t, mesh4, [Shard(0)])
    cases = [
        ("4:S0", d4),
        ("4:S1", distribute_tensor(t, mesh4, [Shard(1)])),
        ("4:R", distribute_tensor(t, mesh4, [Replicate()])),
        ("4:S0->S1", d4.redistribute(mesh4, [Shard(1)])),
        ("22:R,S0", distribute_tensor(t, mesh22, [Replicate(), Shard(0)])),
        ("22:S0,S1", distribute_tensor(t, mesh22, [Shard(0), Shard(1)])),
        ("22:S1,S1", distribute_tensor(t, mesh22, [Shard(1), Shard(1)])),
        ("22:S1,R", distribute_tensor(t, mesh22, [Shard(1), Replicate()])),
    ]
    # 4 shards -> 2 shards (each held by a replicate pair), by redistribution on the 2x2 mesh
    d22 = distribute_tensor(t, mesh22, [Shard(0), Shard(1)])
    cases.append(("22:S0,S1->R,S0", d22.redistribute(mesh22, [Replicate(), Shard(0)])))
    return cases


def dtensor_full_signatures(rank, world):
    """Full signatures of tensors of several dtypes and shapes as plain tensors and under each DTensor placement."""
    torch.manual_seed(0)
    tensors = {
        "f32": torch.randn(10, 7),
        "bf16": torch.randn(5, 9).to(torch.bfloat16),
        "i64": torch.randint(-(2**40), 2**40, (6, 3, 5)),
        "c64": torch.randn(7, 4, dtype=torch.complex64),
        "u8": torch.randint(0, 256, (9, 2), dtype=torch.uint8),
    }
    out = {"plain": full_signatures(tensors)}
    for name, t in tensors.items():
        for label, dt in _dtensor_cases(t):
            out.setdefault(label, {})[name] = full_signatures({name: dt})[name]
    out["local_partial"] = {
        name: signature_hex(tensor_signature(dt)) for name, dt in [("f32", _dtensor_cases(tensors["f32"])[0][1])]
    }
    from torch.distributed.tensor import DTensor, Partial

    pending = DTensor.from_local(torch.ones(2), _dtensor_cases(tensors["u8"])[0][1].device_mesh, [Partial()])
    try:  # a pending reduction has no full value to fingerprint: refused on every rank alike
        full_signatures({"p": pending})
        out["partial"] = "accepted"
    except ValueError:
        out["partial"] = "rejected"
    return out


def dcp_save_sharded(rank, world, path):
    """Save a Shard(1) DTensor (and scalars) with DCP on 4 ranks; return the full signatures of what was saved."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(1)
    mesh = init_device_mesh("cpu", (world,))
    state = {
        "model": {
            "w": distribute_tensor(torch.randn(6, 10), mesh, [Shard(1)]),
            "b": distribute_tensor(torch.randn(10), mesh, [Shard(0)]),
        }
    }
    sigs = full_signatures(state)
    dcp.save(state, checkpoint_id=path)
    dist.barrier()
    return sigs


# ---- single-pass signatures (issue 13): one hash per byte must still catch every change ----------------------------

INTERIOR = 37  # an element well inside every tensor compared below: never element 0


def single_pass_consensus(rank, world, flip_rank=None):
    """Consensus hashed in the background thread (start_consensus), its replica rows reused for the load-verification
    signatures; `flip_rank` flips one bit of an interior element of its weight first."""
    from scout_ckpt.consensus.save_time import start_consensus

    state = replicated_state()
    groups = ConsensusGroups.create("ddp", world, None, timeout_s=30)
    flat = flatten_state(state)
    if flip_rank == rank:
        flip_bit(flat["app.model.0.weight"], element=INTERIOR, bit=9)
    # The hashing waits for the write to start (the Checkpointer's writer says so): not a byte hashed before.
    import time as _time

    from scout_ckpt.consensus.in_flight import InFlightDigests

    in_flight = InFlightDigests()
    pending = start_consensus(state, groups, background=True, in_flight=in_flight)
    _time.sleep(0.3)
    held = not pending._work.done()
    in_flight.release()
    known = pending.replica_rows()
    evidence = pending.finish()
    reused = full_signatures(state, plain="replica", known=known)
    fresh = full_signatures(state, plain="replica")
    # Every leaf was hashed on every rank (DDP), so the signatures need no collective (complete=True) ...
    full = pending.full_rows()
    complete = full_signatures(state, plain="replica", known=full, complete=True) if full is not None else None
    # ... unless one rank leaves a leaf out: then no rank may skip the collective (else the others would hang).
    odd = start_consensus(state, groups, names_filter=(lambda n: not n.endswith("bias")) if rank == 1 else None)
    odd.finish()
    return {
        "evidence": evidence,
        "reused": reused,
        "fresh": fresh,
        "n_known": len(known),
        "held": held,
        "n_leaves": len(flat),
        "complete": complete,
        "odd_covers": odd.everyone_covers,
    }


def sharded_change_at_load(rank, world):
    """Full signature of a Shard(0) DTensor before and after one interior element of one rank's shard changes,
    and of the same tensor whole (the additive definition, no process group)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(3)
    full = torch.randn(8, 6)
    mesh = init_device_mesh("cpu", (world,))
    dt = distribute_tensor(full.clone(), mesh, [Shard(0)])
    before = full_signatures({"w": dt})["w"]
    if rank == world - 1:
        flip_bit(dt.to_local(), element=2 * 6 + 3, bit=0)  # row 2, column 3 of the last shard: interior
    after = full_signatures({"w": dt})["w"]
    return {"before": before, "after": after, "whole": full_signatures({"w": full})["w"]}


def checkpointer_load_change(rank, world, root, async_save):
    """Two saves through the Checkpointer (sync or async: the async one signs DCP's staged copy), then a restart
    whose load of step 2 sees one interior element of `w` changed on every rank (after_load hook): load
    verification must reject step 2 and load step 1."""
    from scout_ckpt.checkpointer import Checkpointer
    from scout_ckpt.ledger import Ledger

    torch.manual_seed(0)
    state = {"model": {"w": torch.randn(64, 48), "b": torch.randn(48)}, "step": 0}
    ck = Checkpointer(root, async_save=async_save, timeout_s=120)
    verdicts = []
    for step in (1, 2):
        state["model"]["w"].add_(1.0)
        state["step"] = step
        ck.save(step, state)
        ck.wait()
        verdicts.append(ck.last_verdict["state"])
    ck.close()

    def hook(point, step):
        if point == "after_load" and step == 2:
            state["model"]["w"].view(-1)[INTERIOR * 10 + 1] += 0.5

    with fault_points(hook):
        ck2 = Checkpointer(root, timeout_s=120)
    loaded = ck2.load_latest_clean(state)
    ck2.close()
    out = {"verdicts": verdicts, "loaded": loaded, "step": state["step"]}
    if rank == 0:
        with Ledger.open(root) as led:
            row = led.checkpoint(2)
            out["step2"] = row["state"]
            out["step2_reasons"] = [r["code"] for r in row["reasons"]]
    return out


def in_flight_consensus(rank, world, root, flip_rank=None):
    """A sync save's consensus as the Checkpointer runs it (background hashing, DCP's write through ScoutWriter
    signing the tensors this rank writes), on a state of large tensors; `flip_rank` flips one bit of an interior
    element of every large tensor first, so each is written, and signed in flight, by some rank."""
    import torch.distributed.checkpoint as dcp

    from scout_ckpt.consensus.in_flight import InFlightDigests
    from scout_ckpt.consensus.save_time import start_consensus
    from scout_ckpt.save.storage import ScoutWriter

    torch.manual_seed(4)
    shared = torch.randn(96, 128)
    state = {
        "m": {f"w{i}": torch.randn(128 + i, 160) for i in range(6)},
        "tied": {"a": shared, "b": shared},  # one memory, two names (tied weights)
        "cols": torch.randn(160, 130).t(),  # transposed: DCP writes its storage column-major
        "small": torch.randn(10),
        "step": 3,
    }
    large = [f"m.w{i}" for i in range(6)] + ["tied.a", "tied.b", "cols"]
    flat = flatten_state(state)
    if rank == flip_rank:
        for i, name in enumerate(large):
            if name != "tied.b":  # tied.a's memory is tied.b's
                t = flat[name] if flat[name].is_contiguous() else flat[name].t()  # the same memory
                flip_bit(t, element=t.numel() // 2 + i, bit=11)
    groups = ConsensusGroups.create("ddp", world, None, timeout_s=60)
    in_flight = InFlightDigests()
    try:
        pending = start_consensus(state, groups, background=True, in_flight=in_flight)
        writer = ScoutWriter(root, step=1)
        writer.in_flight = in_flight
        dcp.save(state, storage_writer=writer)
    finally:
        in_flight.release()
    evidence = pending.finish()
    fresh = save_time_consensus(state, groups)  # every byte hashed by consensus itself, no writer involved
    return {
        "evidence": evidence,
        "fresh": fresh,
        "delivered": in_flight.delivered,
        "expected": len(in_flight._expected),
    }


def shard_partials_in_background(rank, world):
    """The DTensor partial signatures the consensus thread computes during a sync save's write (start_consensus
    with ConsensusGroups.sign_partials), against the full signatures of the whole tensors, computed apart."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from scout_ckpt.consensus.full import shard_partials
    from scout_ckpt.consensus.in_flight import InFlightDigests
    from scout_ckpt.consensus.save_time import start_consensus

    groups = ConsensusGroups.create("fsdp", world, timeout_s=30)
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(7)
    whole = {
        "w": torch.randn(9, 5, generator=g),
        "v": torch.randn(4, 7, generator=g).to(torch.bfloat16),
        "r": torch.randn(6, generator=g),
    }
    state = {
        "w": distribute_tensor(whole["w"], mesh, [Shard(0)]),  # uneven: 5 + 4 rows
        "v": distribute_tensor(whole["v"], mesh, [Shard(1)]),
        "r": distribute_tensor(whole["r"], mesh, [Replicate()]),
        "lr": torch.tensor([1e-3]),
        "step": 3,
    }
    out = {}
    for want in (False, True):
        groups.sign_partials = want
        in_flight = InFlightDigests()
        pending = start_consensus(state, groups, background=True, in_flight=in_flight)
        in_flight.release()  # no writer in this test: the hashing gate opens at once
        partials = pending.shard_partials()
        pending.finish()
        out[want] = sorted(partials)
        if want:
            out["same_as_inline"] = all(
                torch.equal(partials[k], v) for k, v in shard_partials(flatten_state(state, keep_dtensor=True)).items()
            )
            out["with_partials"] = full_signatures(state, plain="replica", partials=partials)
            bad = dict(partials, w=partials["w"] + 1)  # a wrong row must show: the rows are really taken
            out["tampered"] = full_signatures(state, plain="replica", partials=bad)["w"]
    out["inline"] = full_signatures(state, plain="replica")
    out["whole"] = {k: full_signatures({k: v})[k] for k, v in whole.items()}
    return out
