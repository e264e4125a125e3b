"""Step and request statistics: the numbers that feed metrics, policies and profiles."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Acceptance:
    """Draft tokens proposed and accepted; shared by step and request statistics."""

    proposed: int = 0
    """Draft tokens proposed."""
    accepted: int = 0
    """Draft tokens the target accepted."""
    accepted_per_position: list[int] = field(default_factory=list)
    """accepted_per_position[i]: how often draft token i (0-based) was accepted."""

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


@dataclass
class StepStats(Acceptance):
    """What one engine step did, across the whole running batch."""

    batch_size: int = 0
    """Sequences decoded in this step."""
    k: int = 0
    """Speculation length chosen for this step."""
    generated: int = 0
    """Tokens committed this step (accepted + one recovered or bonus per sequence)."""
    prefilled: int = 0
    """Sequences admitted (prefilled) this step."""
    backlog_checked: int = 0
    """Committed tokens the draft scored while catching up after steps without speculation."""
    backlog_matched: int = 0
    """How many of those its greedy prediction matched: acceptance evidence at no extra forward."""
    draft_s: float = 0.0
    """Seconds in draft forwards (proposals and draft prefill)."""
    verify_s: float = 0.0
    """Seconds in target forwards (verification and target prefill)."""
    other_s: float = 0.0
    """Seconds in everything else: scheduling, acceptance bookkeeping, detokenizing."""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RequestStats(Acceptance):
    """One request's totals, returned with its last output."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    """Decode steps this request took part in (prefill not counted)."""
    queue_s: float = 0.0
    """Seconds from arrival to admission."""
    ttft_s: float = 0.0
    """Seconds from arrival to the first generated token."""
    total_s: float = 0.0
    """Seconds from arrival to finish."""

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first."""
        n = self.generated_tokens - 1
        return (self.total_s - self.ttft_s) / n if n > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["acceptance_rate"] = round(self.acceptance_rate, 4)
        d["tpot_s"] = self.tpot_s
        return d

    def add_step(self, k: int, num_accepted: int) -> None:
        self.steps += 1
        self.proposed += k
        self.accepted += num_accepted
        if len(self.accepted_per_position) < k:
            self.accepted_per_position += [0] * (k - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1
