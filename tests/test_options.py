"""Options as validated dataclasses (scout_ckpt/options.py): one spelling per group at the Checkpointer (the
dataclass, or a bool), a config file's table converted by `from_dict`; every documented spelling constructs a
Checkpointer and reaches the component it configures; a misspelled key, a bad value or another spelling fails at
construction with one line naming the field or the dataclass, before anything collective."""

from __future__ import annotations

import dataclasses

import pytest

from scout_ckpt import options
from scout_ckpt.errors import BadOption, ScoutError
from scout_ckpt.options import (
    FleetOptions,
    LocalTierOptions,
    ObserverOptions,
    ReplayOptions,
    ShardEvidenceOptions,
    StorageOptions,
    StragglerRule,
)
from scout_ckpt.testing.launch import run_ranks

# ---- pure: conversion and validation ----------------------------------------------------------------------


def test_a_config_files_table_converts_with_from_dict():
    assert ReplayOptions.from_dict({"targets": ["0", "2", "optimizer"], "interval": 10}) == ReplayOptions(
        targets=("0", "2", "optimizer"), interval=10
    )
    obs = ObserverOptions.from_dict({"stall_s": 3, "action": "abort", "straggler": {"window_s": 0.5}})
    assert obs == ObserverOptions(stall_s=3, action="abort", straggler=StragglerRule(window_s=0.5))
    assert isinstance(obs.straggler, StragglerRule)
    assert ShardEvidenceOptions.from_dict({"cycle": 4}) == ShardEvidenceOptions(cycle=4)
    assert LocalTierOptions.from_dict({"dir": "/dev/shm/x", "every": 5}) == LocalTierOptions(dir="/dev/shm/x", every=5)
    assert FleetOptions.from_dict({"path": "/x/f.db", "interval_s": 1}) == FleetOptions(path="/x/f.db", interval_s=1)
    # a whole table of Checkpointer options (Lightning's YAML, a JSON flag): groups converted, the rest as given
    table = {"replay": {"interval": 5}, "observer": False, "keep": 3, "local": {"dir": "/d", "every": 2}}
    assert options.from_config(table) == {
        "replay": ReplayOptions(interval=5),
        "observer": False,
        "keep": 3,
        "local": LocalTierOptions(dir="/d", every=2),
    }


def test_the_components_internal_form():
    """What the Checkpointer lets through, as the components take it: True is None (the defaults where they
    apply), an instance an explicit request, False off."""
    assert options.as_replay(True) is None and options.as_replay(False) is False
    given = ReplayOptions(interval=3)
    assert options.as_replay(given) is given
    assert options.as_observer(True) == ObserverOptions() and options.as_observer(False) is False
    assert options.as_shard_evidence(True) is None
    assert options.as_local(False) is None
    assert (
        options.as_fleet(True, environ={}) is None
        and options.as_fleet(False, environ={"SCOUT_CKPT_FLEET": "/f"}) is None
    )
    assert options.as_fleet(True, environ={"SCOUT_CKPT_FLEET": "/x/f.db"}) == FleetOptions(path="/x/f.db")
    assert options.as_fleet("/y/f.db") == FleetOptions(path="/y/f.db")
    assert options.as_storage(ledger_journal="delete") == StorageOptions(ledger_journal="delete")


@pytest.mark.parametrize(
    "name, value, says",
    [
        (
            "replay",
            {"interval": 5},
            "replay must be True, False or a ReplayOptions (got a dict; ReplayOptions.from_dict",
        ),
        ("observer", {"stall_s": 3}, "observer must be True, False or an ObserverOptions (got a dict"),
        ("shard_evidence", None, "shard_evidence must be True, False or a ShardEvidenceOptions (got None)"),
        ("replay", "on", "replay must be True, False or a ReplayOptions (got str)"),
        ("local", {"dir": "/d", "every": 2}, "local must be False or a LocalTierOptions (got a dict"),
        ("local", True, "local=True names no directory"),
        ("local", None, "local must be False or a LocalTierOptions (got None)"),
        ("fleet", {"path": "/x"}, "fleet must be True, False, a path or a FleetOptions (got a dict"),
        ("fleet", None, "fleet must be True, False, a path or a FleetOptions (got None)"),
    ],
)
def test_one_spelling_per_group_at_the_checkpointer(name, value, says):
    with pytest.raises(BadOption) as e:
        options.check_group(name, value)
    msg = str(e.value)
    assert msg.startswith(says) and "\n" not in msg, msg


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
        (ObserverOptions.from_dict, {"stal_s": 3}, "'stal_s'"),
        (ObserverOptions.from_dict, {"straggler": {"windw_s": 0.5}}, "observer.straggler: unknown option 'windw_s'"),
        (ObserverOptions.from_dict, {"action": "kill"}, "observer.action"),
        (ObserverOptions.from_dict, {"stall_s": -1}, "observer.stall_s"),
        (ObserverOptions.from_dict, {"stall_s": float("nan")}, "observer.stall_s"),
        (ObserverOptions.from_dict, {"straggler": {"rounds": 0}}, "observer.straggler.rounds"),
        (ObserverOptions.from_dict, {"ddp_comm_hook": "fast"}, "observer.ddp_comm_hook"),
        (ObserverOptions.from_dict, "abort", "observer must be a table"),
        (ReplayOptions.from_dict, {"intervall": 5}, "replay: unknown option 'intervall'"),
        (ReplayOptions.from_dict, {"interval": 0}, "replay.interval"),
        (ReplayOptions.from_dict, {"interval": 2.5}, "replay.interval"),
        (ReplayOptions.from_dict, {"peers": "some"}, "replay.peers"),
        (ReplayOptions.from_dict, {"targets": "0"}, "replay.targets"),
        (ReplayOptions.from_dict, {"save_every": True}, "replay.save_every"),
        (ReplayOptions.from_dict, {"self_check": "yes"}, "replay.self_check"),
        (ReplayOptions.from_dict, {"self_check": 1}, "replay.self_check"),
        (ReplayOptions.from_dict, {"live_check": None}, "replay.live_check"),
        (LocalTierOptions.from_dict, {"dir": "/dev/shm/x"}, "local.every"),
        (LocalTierOptions.from_dict, {"dir": "", "every": 5}, "local.dir"),
        (LocalTierOptions.from_dict, {"dir": "/dev/shm/x", "every": 5, "keep": 0}, "local.keep"),
        (LocalTierOptions.from_dict, {"dir": "/dev/shm/x", "every": 5, "replicas": -1}, "local.replicas"),
        (
            LocalTierOptions.from_dict,
            {"dir": "/dev/shm/x", "every": 5, "replica": 1},
            "local: unknown option 'replica'",
        ),
        (ShardEvidenceOptions.from_dict, {"cycel": 4}, "shard_evidence: unknown option 'cycel'"),
        (ShardEvidenceOptions.from_dict, {"at_rest_every": 0}, "shard_evidence.at_rest_every"),
        (FleetOptions.from_dict, {"path": "/x/f.db", "interval": 3}, "fleet: unknown option 'interval'"),
        (FleetOptions.from_dict, {"path": "/x/f.db", "on_suspect": "reboot"}, "fleet.on_suspect"),
        (lambda v: ObserverOptions(straggler=v), {"window_s": 0.5}, "observer.straggler must be a StragglerRule"),
        (options.from_config, {"replay": {"intervall": 5}}, "replay: unknown option 'intervall'"),
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
        ObserverOptions.from_dict({"stall": 3})


def test_storage_refuses_a_bad_journal_mode():
    with pytest.raises(BadOption, match="storage.ledger_journal"):
        StorageOptions(ledger_journal="wall")


def test_options_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ReplayOptions().interval = 3


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"observer": {"stall_s": 3}}, "observer must be True, False or an ObserverOptions"),
        ({"replay": {"interval": 2}}, "ReplayOptions.from_dict"),
        ({"replay": None}, "replay must be"),
        ({"shard_evidence": {"cycle": 2}}, "ShardEvidenceOptions"),
        ({"keep": 0}, "keep"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"consensus_exclude": "rng.*"}, "consensus_exclude"),
        ({"ledger_journal": "wall"}, "ledger_journal"),
        ({"local": {"dir": "x", "every": 1}}, "LocalTierOptions"),
        ({"local": None}, "local must be"),
        ({"fleet": {"path": "x"}}, "FleetOptions"),
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
    "replay=ReplayOptions targets": {"replay": ReplayOptions(targets=("blocks.0", "head", "optimizer"), interval=10)},
    "replay=ReplayOptions save_every": {"replay": ReplayOptions(save_every=4)},
    "replay=ReplayOptions demo": {"replay": ReplayOptions(interval=1, save_every=5)},
    "replay=ReplayOptions": {"replay": ReplayOptions(interval=4)},
    "observer=True": {"observer": True},
    "observer=False": {"observer": False},
    "observer=from_dict": {
        "observer": ObserverOptions.from_dict(
            {"stall_s": 5, "action": "abort", "straggler": {"window_s": 0.5}, "count_hz": 10}
        )
    },
    "observer user hook": {"observer": ObserverOptions(ddp_comm_hook=user_comm_hook, ddp_comm_state={"k": 1})},
    "observer=ObserverOptions": {
        "observer": ObserverOptions(stall_s=30, straggler=StragglerRule(rounds=2), ddp_comm_hook="traced")
    },
    "shard_evidence=True": {"shard_evidence": True},
    "shard_evidence=False": {"shard_evidence": False},
    "shard_evidence at_rest_every": {"shard_evidence": ShardEvidenceOptions(at_rest_every=2)},
    "shard_evidence=ShardEvidenceOptions": {"shard_evidence": ShardEvidenceOptions(cycle=4)},
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
    assert seen["replay=ReplayOptions targets"]["replay_interval"] == 10
    assert seen["replay=ReplayOptions"]["replay_interval"] == 4
    assert seen["observer=True"]["observer"] and seen["observer=True"]["stall_s"] == 60.0
    assert (seen["observer=from_dict"]["stall_s"], seen["observer=from_dict"]["window_s"]) == (5, 0.5)
    assert (seen["observer=ObserverOptions"]["stall_s"], seen["observer=ObserverOptions"]["window_s"]) == (30, 1.0)
    assert seen["replay=ReplayOptions save_every"]["replay_save_every"] == 4
    demo = seen["replay=ReplayOptions demo"]
    assert (demo["replay_interval"], demo["replay_save_every"]) == (1, 5)
    assert seen["observer=from_dict"]["count_period"] == 0.1
    assert seen["observer=ObserverOptions"]["comm_hook"] == ["traced", None]
    assert seen["observer user hook"]["comm_hook"] == ["user_comm_hook", {"k": 1}]
    assert seen["observer=True"]["count_period"] == 1 / 25 and seen["observer=True"]["comm_hook"] == [None, None]
    # asked for with a ShardEvidenceOptions: on whatever the layout; True: only where shards exist (none in DDP)
    assert seen["shard_evidence at_rest_every"]["shard"] and seen["shard_evidence=ShardEvidenceOptions"]["shard"]
    assert not seen["shard_evidence=True"]["shard"]
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
