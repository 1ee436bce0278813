"""Synthetic token streams with learnable structure, a checkpointable read position, and online domain mixing.

Each domain is a fixed random Markov chain over the vocabulary in which every token has a few likely successors
(domain d has 2, 4, 8, ... of them, so domains differ in difficulty). Sample i of the run is generated from a
generator seeded by (seed, i) alone, so the stream is a pure function of the sample counter: resuming needs only
that counter, and any data-parallel layout reads the same global batch.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful


class MarkovDomains:
    def __init__(self, vocab: int = 256, n_domains: int = 1, seed: int = 0):
        self.vocab = vocab
        self.n_domains = n_domains
        self.succ, self.prob = [], []
        for d in range(n_domains):
            rng = np.random.default_rng([seed, 7919, d])
            k = min(2 ** (d + 1), vocab)
            self.succ.append(np.stack([rng.choice(vocab, size=k, replace=False) for _ in range(vocab)]))
            p = rng.dirichlet(np.ones(k), size=vocab)
            self.prob.append(np.cumsum(p, axis=1))

    def sample(self, rng: np.random.Generator, domain: int, length: int) -> np.ndarray:
        succ, cum = self.succ[domain], self.prob[domain]
        out = np.empty(length, dtype=np.int64)
        out[0] = rng.integers(self.vocab)
        u = rng.random(length)
        for t in range(1, length):
            row = cum[out[t - 1]]
            out[t] = succ[out[t - 1], min(int(np.searchsorted(row, u[t])), len(row) - 1)]
        return out


class DataStream(Stateful):
    """Global batch `step` of the run is samples [step*B, (step+1)*B); this rank reads its contiguous slice.
    `position` (the number of global batches consumed) is the checkpointed state."""

    def __init__(
        self,
        domains: MarkovDomains,
        seq_len: int,
        global_batch: int,
        rank: int,
        world: int,
        seed: int = 0,
        mixer: "OnlineMixer | None" = None,
    ):
        if global_batch % world:
            raise ValueError(f"global batch {global_batch} is not divisible by {world} ranks")
        self.domains, self.seq_len, self.global_batch = domains, seq_len, global_batch
        self.rank, self.world, self.seed, self.mixer = rank, world, seed, mixer
        self.position = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(inputs, targets, domain ids) of this rank's share of the next global batch."""
        per_rank = self.global_batch // self.world
        first = self.position * self.global_batch + self.rank * per_rank
        weights = self.mixer.weights.numpy() if self.mixer is not None else None
        seqs, doms = [], []
        for i in range(first, first + per_rank):
            rng = np.random.default_rng([self.seed, i])
            d = int(rng.choice(self.domains.n_domains, p=weights)) if weights is not None else 0
            seqs.append(self.domains.sample(rng, d, self.seq_len + 1))
            doms.append(d)
        self.position += 1
        x = torch.from_numpy(np.stack(seqs))
        return x[:, :-1].contiguous(), x[:, 1:].contiguous(), torch.tensor(doms, dtype=torch.int64)

    def state_dict(self) -> dict:
        return {
            "position": torch.tensor(self.position, dtype=torch.int64),
            "seed": torch.tensor(self.seed, dtype=torch.int64),
        }

    def load_state_dict(self, sd: dict) -> None:
        self.position = int(sd["position"])
        self.seed = int(sd["seed"])


class OnlineMixer(Stateful):
    """Mixture weights over domains, moved by exponentiated gradient toward the domains with higher loss.

    w_d <- w_d * exp(eta * (L_d - mean L)), renormalised, then mixed with the uniform distribution (floor `eps`),
    so the weights stay strictly on the simplex. The losses are all-reduced before the update, so every rank
    computes bitwise the same weights in the same float64 arithmetic.
    """

    def __init__(self, n_domains: int, eta: float = 0.5, eps: float = 0.05):
        self.n_domains, self.eta, self.eps = n_domains, eta, eps
        self.weights = torch.full((n_domains,), 1.0 / n_domains, dtype=torch.float64)
        self.updates = 0

    def domain_stats(self, per_sample_loss: torch.Tensor, domain: torch.Tensor) -> torch.Tensor:
        """This rank's [sum of loss, count] per domain; the caller all-reduces it before `update`."""
        stats = torch.zeros(2, self.n_domains, dtype=torch.float64)
        stats[0].index_add_(0, domain, per_sample_loss.detach().double())
        stats[1].index_add_(0, domain, torch.ones_like(domain, dtype=torch.float64))
        return stats

    def update(self, stats: torch.Tensor) -> None:
        seen = stats[1] > 0
        if not bool(seen.any()):
            return
        mean = torch.where(seen, stats[0] / stats[1].clamp(min=1), torch.zeros_like(stats[0]))
        centred = torch.where(seen, mean - mean[seen].mean(), torch.zeros_like(mean))
        w = self.weights * torch.exp(self.eta * centred)
        w = w / w.sum()
        self.weights = (1 - self.eps) * w + self.eps / self.n_domains
        self.updates += 1

    def check(self) -> None:
        """The simplex invariant: non-negative weights summing to one."""
        w = self.weights
        if not (bool((w >= 0).all()) and math.isclose(float(w.sum()), 1.0, abs_tol=1e-9)):
            raise AssertionError(f"mixture weights off the simplex: {w.tolist()}")

    def state_dict(self) -> dict:
        return {"weights": self.weights.clone(), "updates": torch.tensor(self.updates, dtype=torch.int64)}

    def load_state_dict(self, sd: dict) -> None:
        self.weights = sd["weights"].to(torch.float64).clone()
        self.updates = int(sd["updates"])
