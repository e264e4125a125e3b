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
class RowOutcomes:
    """Row by row, what a step with a per-row plan (`draftplan.DraftPlan`) drafted and got accepted."""

    ids: list[str]
    """The decoding rows' request ids."""
    drafted: list[int]
    """Tokens each row drafted."""
    accepted: list[int]
    """Of those, how many the target accepted."""
    conf: list[list[float]] | None = None
    """The draft's confidence at each drafted position of each row."""
    lookup: list[bool] | None = None
    """Whether the row's tokens were copied from its own context (prompt lookup)."""
    constrained: list[bool] | None = None
    """Whether the row's output is constrained (structured output: a grammar, a forced tool call)."""
    history: list[bool] | None = None
    """Whether the row's copy came from the suffix history of earlier outputs (a `lookup` row)."""


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
    """Sequences whose prefill finished this step (they got their first token)."""
    admitted: int = 0
    """Requests admitted this step (their prefill starts, in chunks)."""
    preempted: int = 0
    """Running requests sent back to the queue because the KV pool ran short."""
    scheduled_tokens: int = 0
    """Tokens the target's forward fed this step: (k + 1) per decoding sequence + prefill chunks. At most
    `EngineConfig.max_num_batched_tokens`."""
    prefill_tokens: int = 0
    """Prompt tokens prefilled (in chunks) this step."""
    chunks: tuple[tuple[int, int], ...] = ()
    """(KV tokens the row already held, prompt tokens fed) per prompt chunk this step: a chunk's attention reads
    all its row held, so its price grows with the first (`LatencyGrid.chunk_context_ms`)."""
    prefix_queried: int = 0
    """Prompt tokens of the admitted requests looked up in the prefix cache (whole blocks)."""
    prefix_hits: int = 0
    """Of those, tokens found cached (their KV taken by reference, not computed)."""
    predicted: int = 0
    """Tokens drafted from requests' predicted outputs (not the policy's: their rows are not in `k`)."""
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
    gap_s: float = 0.0
    """Seconds from the previous step's end to this one's start while the serving loop ran on (handing the
    outputs to their streams, the hop to the step's thread); 0 for a step the loop started with."""
    rows: RowOutcomes | None = None
    """Per row, with a per-row plan (k is then the longest row's drafted tokens, proposed their sum)."""
    by_source: dict[str, list[int]] = field(default_factory=dict)
    """Draft tokens [proposed, accepted] by where they came from: `model` (the draft model), `context` (copied
    from the row's own context: prompt lookup), `history` (copied from earlier outputs: `engine.history`)."""
    draft_forwards: int = 0
    """Forwards the draft model ran for the step's proposal (k at a fixed k; fewer when a plan stopped rows or rows
    copied from their context; 1 when a plan kept nothing after the first): its draft time is priced by them."""
    contexts: tuple[int, ...] = ()
    """KV tokens each decoding row attended at the step's start (prompt + generated), in the batch's order:
    calibration prices the step at them, so its factors measure the machine, not the context."""

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
    resumes: int = 0
    """Times the request was resumed on repaired workers after a failed step."""
    carried_tokens: int = 0
    """Tokens generated by another replica before this one continued the request (counted there)."""
    cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache (OpenAI's usage.prompt_tokens_details.cached_tokens)."""
    preemptions: int = 0
    """Times the request went back to the queue because the KV pool ran short (prefilled again later)."""
    accepted_prediction_tokens: int = 0
    """With a predicted output: its tokens that made it into the output (OpenAI's usage counts)."""
    rejected_prediction_tokens: int = 0
    """With a predicted output: its tokens that did not."""

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
