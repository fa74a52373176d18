"""Sampling parameters and the sampler (runs on TP rank 0)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks tokens and when it stops.

    ``temperature`` 0 is greedy. With ``seed`` set, the token at output index
    ``i`` is drawn from a generator seeded by ``(seed, i)``, so a seeded request
    gives the same tokens whatever it is batched with; without a seed the
    engine draws one when the request arrives.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class SampleSpec:
    """What the sampler needs for one sequence in one step."""

    temperature: float
    top_p: float
    seed: int
    index: int  # output position of the token being drawn


def sample(logits: torch.Tensor, specs: list[SampleSpec]) -> list[int]:
    """One token per row of ``logits`` [num_seqs, vocab]."""
    out = logits.argmax(dim=-1).tolist()
    for i, spec in enumerate(specs):
        if spec.temperature == 0:
            continue
        probs = torch.softmax(logits[i].double() / spec.temperature, dim=-1)
        if spec.top_p < 1:
            probs = _top_p(probs, spec.top_p)
        # Stateless per-token generator: results do not depend on batch composition.
        g = torch.Generator().manual_seed((spec.seed * 1_000_003 + spec.index) % (1 << 63))
        out[i] = int(torch.multinomial(probs, 1, generator=g))
    return out


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``."""
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(0) - sorted_probs  # mass of strictly more likely tokens
    sorted_probs[before >= top_p] = 0
    return torch.zeros_like(probs).scatter_(0, order, sorted_probs)
