"""Options as validated dataclasses (scout_ckpt/options.py): every documented spelling still constructs a
Checkpointer and reaches the component it configures; a misspelled key or a bad value fails at construction with
one line naming the field, before anything collective."""

from __future__ import annotations

import dataclasses

import pytest

from scout_ckpt import options
from scout_ckpt.errors import BadOption, ScoutError
from scout_ckpt.options import (
    ObserverOptions,
    ReplayOptions,
    ShardEvidenceOptions,
    StorageOptions,
    StragglerRule,
)
from scout_ckpt.testing.launch import run_ranks

# ---- pure: conversion and validation ----------------------------------------------------------------------


def test_old_spellings_convert_to_the_dataclasses():
    assert options.as_replay(None) is None and options.as_replay(False) is False
    assert options.as_replay(True) == ReplayOptions()
    assert options.as_replay({"targets": ["0", "2", "optimizer"], "interval": 10}) == ReplayOptions(
        targets=("0", "2", "optimizer"), interval=10
    )
    obs = options.as_observer({"stall_s": 3, "action": "abort", "straggler": {"window_s": 0.5}})
    assert obs == ObserverOptions(stall_s=3, action="abort", straggler=StragglerRule(window_s=0.5))
    assert isinstance(obs.straggler, StragglerRule)
    assert options.as_observer(True) == ObserverOptions()
    assert options.as_observer(None) == ObserverOptions() and options.as_observer(False) is False  # on by default
    assert options.as_shard_evidence({"cycle": 4}) == ShardEvidenceOptions(cycle=4)
    assert options.as_storage(ledger_journal="delete") == StorageOptions(ledger_journal="delete")
    given = ReplayOptions(interval=3)
    assert options.as_replay(given) is given


def test_defaults_are_the_components_defaults():
    """The dataclasses restate the defaults the components had (observer.Observer.start, the straggler rule,
    ReplayRunner, ShardUpdateReplay): the old `True` and `{}` spellings keep their meaning."""
    import inspect

    from scout_ckpt.observer import Observer
    from scout_ckpt.observer.stragglers import StragglerMonitor
    from scout_ckpt.replay.runner import ReplayRunner
    from scout_ckpt.replay.shard_optimizer import ShardUpdateReplay

    def defaults(fn, names):
        sig = inspect.signature(fn)
        return {n: sig.parameters[n].default for n in names}

    obs = ObserverOptions().start_kwargs()
    obs.pop("straggler")
    assert defaults(Observer.start, obs) == obs
    assert defaults(StragglerMonitor.__init__, dataclasses.asdict(StragglerRule())) == dataclasses.asdict(
        StragglerRule()
    )
    rep = ReplayOptions().runner_kwargs()
    assert rep.pop("interval") is None  # automatic: 10 until the save period is known, then stretched to it
    assert defaults(ReplayRunner.__init__, rep) == rep
    shard = ShardEvidenceOptions().replay_kwargs()
    assert defaults(ShardUpdateReplay.__init__, shard) == shard


@pytest.mark.parametrize(
    "convert, value, field",
    [
        (options.as_observer, {"stal_s": 3}, "'stal_s'"),
        (options.as_observer, {"straggler": {"windw_s": 0.5}}, "observer.straggler: unknown option 'windw_s'"),
        (options.as_observer, {"action": "kill"}, "observer.action"),
        (options.as_observer, {"stall_s": -1}, "observer.stall_s"),
        (options.as_observer, {"stall_s": float("nan")}, "observer.stall_s"),
        (options.as_observer, {"straggler": {"rounds": 0}}, "observer.straggler.rounds"),
        (options.as_observer, {"ddp_comm_hook": "fast"}, "observer.ddp_comm_hook"),
        (options.as_observer, "abort", "observer must be"),
        (options.as_replay, {"intervall": 5}, "replay: unknown option 'intervall'"),
        (options.as_replay, {"interval": 0}, "replay.interval"),
        (options.as_replay, {"interval": 2.5}, "replay.interval"),
        (options.as_replay, {"peers": "some"}, "replay.peers"),
        (options.as_replay, {"targets": "0"}, "replay.targets"),
        (options.as_replay, {"save_every": True}, "replay.save_every"),
        (options.as_replay, {"self_check": "yes"}, "replay.self_check"),
        (options.as_replay, {"self_check": 1}, "replay.self_check"),
        (options.as_replay, {"live_check": None}, "replay.live_check"),
        (options.as_local, {"dir": "/dev/shm/x"}, "local.every"),
        (options.as_local, {"dir": "", "every": 5}, "local.dir"),
        (options.as_local, {"dir": "/dev/shm/x", "every": 5, "keep": 0}, "local.keep"),
        (options.as_local, {"dir": "/dev/shm/x", "every": 5, "replicas": -1}, "local.replicas"),
        (options.as_local, {"dir": "/dev/shm/x", "every": 5, "replica": 1}, "local: unknown option 'replica'"),
        (options.as_local, "/dev/shm/x", "local must be"),
        (options.as_shard_evidence, {"cycel": 4}, "shard_evidence: unknown option 'cycel'"),
        (options.as_shard_evidence, {"at_rest_every": 0}, "shard_evidence.at_rest_every"),
        (options.as_shard_evidence, 3, "shard_evidence must be"),
    ],
)
def test_a_misspelled_key_or_bad_value_names_the_field(convert, value, field):
    with pytest.raises(BadOption) as e:
        convert(value)
    msg = str(e.value)
    assert field in msg and "\n" not in msg, msg
    assert isinstance(e.value, ScoutError) and isinstance(e.value, ValueError) and e.value.exit_code == 2


def test_unknown_key_lists_the_known_ones():
    with pytest.raises(BadOption, match=r"known: .*stall_s.*straggler"):
        options.as_observer({"stall": 3})


def test_storage_refuses_a_bad_journal_mode():
    with pytest.raises(BadOption, match="storage.ledger_journal"):
        StorageOptions(ledger_journal="wall")


def test_options_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ReplayOptions().interval = 3


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"observer": {"stal_s": 3}}, "stal_s"),
        ({"replay": {"interval": -2}}, "replay.interval"),
        ({"shard_evidence": {"peer": 2}}, "'peer'"),
        ({"keep": 0}, "keep"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"consensus_exclude": "rng.*"}, "consensus_exclude"),
        ({"ledger_journal": "wall"}, "ledger_journal"),
        ({"replay": {"self_check": "on"}}, "replay.self_check"),
        ({"local": {"dir": "x", "every": 0}}, "local.every"),
    ],
)
def test_checkpointer_refuses_bad_options_before_anything_collective(tmp_path, kwargs, field):
    """No process group is initialized here: the option is refused before the Checkpointer even asks for one,
    and nothing is created under ROOT."""
    from scout_ckpt import Checkpointer

    with pytest.raises(BadOption, match=field):
        Checkpointer(tmp_path / "run", **kwargs)
    assert not (tmp_path / "run").exists()


# ---- real ranks: every documented spelling constructs a Checkpointer -------------------------------------------


def user_comm_hook(state, bucket):
    """A user's own DDP comm hook, handed to the observer (docs/integrate.md, DDP comm hooks)."""
    raise AssertionError("never called: the model here is not DDP")


# Every spelling README.md, docs/*.md, examples/ and the demo job (scout_ckpt/demo/train.py) give.
SPELLINGS = {
    "replay=True": {"replay": True},
    "replay=dict": {"replay": {"targets": ["blocks.0", "head", "optimizer"], "interval": 10}},
    "replay=dict save_every": {"replay": {"save_every": 4}},
    "replay=dict demo": {"replay": {"interval": 1, "save_every": 5}},
    "replay=ReplayOptions": {"replay": ReplayOptions(interval=4)},
    "observer=True": {"observer": True},
    "observer=False": {"observer": False},
    "observer=dict": {"observer": {"stall_s": 5, "action": "abort", "straggler": {"window_s": 0.5}, "count_hz": 10}},
    "observer=dict user hook": {"observer": {"ddp_comm_hook": user_comm_hook, "ddp_comm_state": {"k": 1}}},
    "observer=ObserverOptions": {
        "observer": ObserverOptions(stall_s=30, straggler=StragglerRule(rounds=2), ddp_comm_hook="traced")
    },
    "shard_evidence=True": {"mode": "fsdp", "shard_evidence": True},
    "shard_evidence=False": {"mode": "fsdp", "shard_evidence": False},
    "shard_evidence=dict": {"mode": "fsdp", "shard_evidence": {"at_rest_every": 2}},
    "shard_evidence=dict cycle": {"mode": "fsdp", "shard_evidence": {"cycle": 5}},
    "shard_evidence=ShardEvidenceOptions": {"mode": "fsdp", "shard_evidence": ShardEvidenceOptions(cycle=4)},
    "ledger_journal=delete": {"ledger_journal": "delete"},
    "replay=False": {"replay": False},
}


def _model():
    """Two same-class blocks and a head: what replay discovers on its own (replay=True)."""
    import torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.relu(self.fc(x))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block(), Block()])
            self.head = torch.nn.Linear(4, 2)

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    return Net()


def _construct_each(rank: int, world: int, root: str) -> dict:
    """Each documented spelling on real gloo ranks: construct, check what the component received, close."""
    import torch

    from scout_ckpt import Checkpointer

    seen = {}
    for i, (name, kwargs) in enumerate(SPELLINGS.items()):
        torch.manual_seed(0)
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ck = Checkpointer(f"{root}/{i}", model=model, optimizer=opt, **kwargs)
        try:
            seen[name] = {
                "replay_interval": ck.replay.runner.schedule.interval if ck.replay is not None else None,
                "replay_save_every": ck.replay.runner.save_every if ck.replay is not None else None,
                "observer": ck.observer is not None,
                "stall_s": ck.observer.cfg["stall_s"] if ck.observer is not None else None,
                "window_s": ck.observer.cfg["straggler"]["window_s"] if ck.observer is not None else None,
                "count_period": ck.observer.counter.period if ck.observer is not None else None,
                "comm_hook": (
                    None if ck.observer is None else [getattr(h, "__name__", h) for h in ck.observer._ddp_hook]
                ),
                "shard": ck.shard is not None,
                "journal": ck.ledger_journal,
            }
        finally:
            ck.close()
    return seen


@pytest.mark.slow
def test_every_documented_spelling_constructs_a_checkpointer(tmp_path):
    results = [o.result for o in run_ranks(_construct_each, 2, str(tmp_path), timeout=300)]
    seen = results[0]
    assert results[1] == seen  # every rank configured alike
    assert seen["replay=True"]["replay_interval"] == 10
    assert seen["replay=dict"]["replay_interval"] == 10
    assert seen["replay=ReplayOptions"]["replay_interval"] == 4
    assert seen["observer=True"]["observer"] and seen["observer=True"]["stall_s"] == 60.0
    assert (seen["observer=dict"]["stall_s"], seen["observer=dict"]["window_s"]) == (5, 0.5)
    assert (seen["observer=ObserverOptions"]["stall_s"], seen["observer=ObserverOptions"]["window_s"]) == (30, 1.0)
    assert seen["replay=dict save_every"]["replay_save_every"] == 4
    assert (seen["replay=dict demo"]["replay_interval"], seen["replay=dict demo"]["replay_save_every"]) == (1, 5)
    assert seen["observer=dict"]["count_period"] == 0.1
    assert seen["observer=ObserverOptions"]["comm_hook"] == ["traced", None]
    assert seen["observer=dict user hook"]["comm_hook"] == ["user_comm_hook", {"k": 1}]
    assert seen["observer=True"]["count_period"] == 1 / 25 and seen["observer=True"]["comm_hook"] == [None, None]
    assert all(
        seen[k]["shard"]
        for k in (
            "shard_evidence=True",
            "shard_evidence=dict",
            "shard_evidence=dict cycle",
            "shard_evidence=ShardEvidenceOptions",
        )
    )
    assert not seen["shard_evidence=False"]["shard"]
    assert seen["ledger_journal=delete"]["journal"] == "delete"
    # the observer is on by default (the defaults' stall_s), observer=False is the opt-out
    assert seen["ledger_journal=delete"]["observer"] and seen["ledger_journal=delete"]["stall_s"] == 60.0
    assert not seen["observer=False"]["observer"]
    # replay is on by default at 2 ranks (DDP here), with the default interval; replay=False is the opt-out
    assert seen["ledger_journal=delete"]["replay_interval"] == 10 and seen["replay=False"]["replay_interval"] is None


def test_a_torchrun_job_with_restarts_is_told_the_restart_environment_it_needs():
    from scout_ckpt.save.log import restart_hint

    job = {"TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_MAX_RESTARTS": "3"}
    hint = restart_hint(job)
    assert hint is not None and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in hint and "--max-restarts 3" in hint
    assert restart_hint({**job, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}) is None
    assert restart_hint({**job, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None  # no restart: nothing to say
    assert restart_hint({"TORCHELASTIC_MAX_RESTARTS": "3"}) is None  # not under torchrun
