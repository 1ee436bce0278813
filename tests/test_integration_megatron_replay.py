"""Replay through the Megatron-Core drop-in, with its defaults, under real torchrun: a user's training job
(tests/scripts/mg_train_job.py: a tiny GPTModel, Megatron's DistributedDataParallel, TP = PP = 1, DP = the world)
that passes `model=` and calls `ckpt.step(iteration)`. A rank whose transformer layer computes wrongly has its
gradient averaged into every replica by Megatron's all-reduce, so the replicas agree on the poisoned state and
consensus passes; replay must keep every save from then on from being certified, end the generation, and name the
rank at 3 ranks. Judged by where the fault was placed and by the digests the job printed when it saved.

megatron-core is an optional extra (`make test` installs it): a missing megatron-core fails these tests."""

import megatron.core  # noqa: F401
import pytest
import torch

from scout_ckpt.ledger import Ledger
from tests import framework_jobs as jobs
from tests.conftest import REPO
from tests.framework_jobs import events, states

pytestmark = pytest.mark.slow
SCRIPT = REPO / "tests" / "scripts" / "mg_train_job.py"
TRACKER = "latest_checkpointed_iteration.txt"
# What the forward runs, by the names Megatron gives its modules (DistributedDataParallel's `module.` prefix):
# written here from Megatron's GPTModel, not asked of scout-ckpt's discovery.
EVERY_MODULE = {
    "module.embedding",
    "module.decoder.layers.0",
    "module.decoder.layers.1",
    "module.decoder.final_layernorm",
    "module.output_layer",
}


def torchrun(save_dir, ev, *extra, ok=True, nproc=2):
    return jobs.torchrun(SCRIPT, save_dir, ev, *extra, ok=ok, nproc=nproc)


def sdc_events(save_dir):
    with Ledger.open(save_dir, readonly=True) as led:
        return [e for e in led.events() if e["kind"] == "sdc"]


@pytest.mark.scenario
def test_healthy_run_certifies_every_iteration_with_every_module_replayed_and_resumes_the_last(tmp_path):
    save_dir, ev = tmp_path / "ck", tmp_path / "events.jsonl"
    torchrun(save_dir, ev, "--iters", 4, "--save-every", 2)
    saved = {r["step"]: r for r in events(ev, "saved")}
    assert [(s, r["verdict"]) for s, r in saved.items()] == [(2, "certified"), (4, "certified")]
    with Ledger.open(save_dir, readonly=True) as led:
        e4, run = led.evidence(4), led.runs()[-1]
    assert run["policy"]["require"][-1] == "replay"
    assert {t[1] for t in run["policy"]["replay_targets"]} == EVERY_MODULE
    assert e4["replay"]["status"] == "pass" and set(e4["replay"]["coverage"]) == EVERY_MODULE
    assert sdc_events(save_dir) == [] and (save_dir / TRACKER).read_text() == "4"
    ev2 = tmp_path / "events2.jsonl"  # the next job resumes the last certified iteration, as it was saved
    torchrun(save_dir, ev2, "--iters", 6, "--save-every", 2)
    assert [(r["step"], r["digest"]) for r in events(ev2, "resumed")] == [(4, saved[4]["digest"])]


@pytest.mark.scenario
@pytest.mark.parametrize("nproc, where", [pytest.param(2, "forward", marks=pytest.mark.scenario_ci), (3, "backward")])
def test_one_ranks_wrong_layer_is_never_certified_and_the_restart_loads_the_iteration_before_it(tmp_path, nproc, where):
    """Rank 1's second transformer layer is wrong from iteration 3 on (its output, or its MLP's input gradient in
    the backward): the save of iteration 4 is rejected, the generation ends, the tracker keeps naming 2, and the next
    job (healthy) resumes iteration 2 with the digest the job printed when it saved it."""
    save_dir, ev = tmp_path / "ck", tmp_path / "events.jsonl"
    p = torchrun(
        save_dir, ev, "--iters", 6, "--save-every", 2, "--fault-at", 3, "--fault-in", where, ok=False, nproc=nproc
    )
    assert "LiveStateCorrupt" in p.stderr, p.stderr[-3000:]
    saved = {r["step"]: r for r in events(ev, "saved")}
    assert [(s, r["verdict"]) for s, r in saved.items()] == [(2, "certified")]
    assert [r["step"] for r in events(ev, "live_fault")] == [4]
    assert states(save_dir) == {2: "certified", 4: "rejected"}
    assert (save_dir / TRACKER).read_text() == "2"
    with Ledger.open(save_dir, readonly=True) as led:
        e4 = led.evidence(4)
    assert e4["consensus"]["status"] == "pass"  # the replicas agree on the averaged, poisoned state
    assert e4["replay"]["status"] == ("fail" if nproc == 3 else "inconclusive")
    if nproc == 3:
        assert {tuple(e["ranks"]) for e in sdc_events(save_dir)} == {(1,)}
    ev2 = tmp_path / "events2.jsonl"
    torchrun(save_dir, ev2, "--iters", 4, "--save-every", 2, nproc=nproc)
    assert [(r["step"], r["digest"]) for r in events(ev2, "resumed")] == [(2, saved[2]["digest"])]
    assert states(save_dir) == {2: "certified", 4: "certified"}  # saved again, healthy


def test_default_targets_are_megatrons_own_modules_found_by_class_and_name():
    """Megatron's embedding and output layer are not nn.Embedding / nn.Linear heads: named by what Megatron
    builds (a stand-in with Megatron's class names; the real GPTModel is the scenarios' above)."""
    from scout_ckpt.integrations.mg_replay import default_targets

    class LanguageModelEmbedding(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.word_embeddings = torch.nn.Embedding(4, 2)

    class TransformerLayer(torch.nn.Linear):
        pass

    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([TransformerLayer(2, 2), TransformerLayer(2, 2)])
            self.final_layernorm = torch.nn.LayerNorm(2)

    class GPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding, self.decoder, self.output_layer = LanguageModelEmbedding(), Decoder(), torch.nn.Linear(2, 4)

    assert default_targets(GPT()) == (
        "embedding",
        "decoder.layers.0",
        "decoder.layers.1",
        "decoder.final_layernorm",
        "output_layer",
    )
