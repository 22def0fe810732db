"""Speculative-decoding counters with vLLM's and SGLang's definitions: acceptance length
tau = (accepted drafts + drafts) / drafts, i.e. the mean tokens committed per verify step,
bonus included; per-position acceptance = fraction of drafts whose position i was accepted."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    num_draft_slots: int  # B - 1
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    histogram: list[int] = field(default_factory=list)  # histogram[a] = verify steps that accepted a
    paused_steps: int = 0  # engine steps decoded without drafts (speculative_disable_batch_size)
    gated_steps: int = 0  # request steps decoded without drafts by a gate (gate.py: its tau or the batch's low)

    def __post_init__(self) -> None:
        self.accepted_per_position = self.accepted_per_position or [0] * self.num_draft_slots
        self.histogram = self.histogram or [0] * (self.num_draft_slots + 1)

    def record(self, accepted: int, drafted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        self.histogram[accepted] += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_length(self) -> float:
        return (self.num_accepted_tokens + self.num_drafts) / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict:
        n = self.num_drafts
        return {"acceptance_length": self.acceptance_length, "num_drafts": n,
                "num_draft_tokens": self.num_draft_tokens, "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_position": list(self.accepted_per_position),
                "acceptance_rate_per_position": [c / n if n else 0.0 for c in self.accepted_per_position],
                "acceptance_histogram": list(self.histogram), "paused_steps": self.paused_steps,
                "gated_steps": self.gated_steps}
