"""SamplingParams, RequestOutput, Request: plain Python, no torch."""

import enum
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

MAX_TOP_LOGPROBS = 20


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 0  # 0 = until EOS or the end of the context
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # <= 0 = off (LocalAI sends -1 for kimi)
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF semantics on prompt + output tokens; 1 = off
    presence_penalty: float = 0.0  # OpenAI semantics on output tokens
    frequency_penalty: float = 0.0
    seed: Optional[int] = None  # None = drawn by the engine
    ignore_eos: bool = False
    stop_token_ids: tuple = ()
    logit_bias: dict = field(default_factory=dict)  # token id -> bias added to the logit
    logprobs: bool = False
    top_logprobs: int = 0  # 0..20 alternatives per token (needs logprobs)
    grammar: Optional[object] = None  # backend.engine.structured.Grammar: every token must extend its language
    # scoring (the Score RPC): generate nothing; the final output holds log P(prompt[i] | prompt[:i]) for every
    # i >= score_from (raw logits: no temperature, bias or filters), in RequestOutput.scores. None = generate
    score_from: Optional[int] = None

    def validate(self, vocab_size: int) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be an integer >= 0 (0 = until EOS), got {self.max_tokens!r}")
        if not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an integer (<= 0 = off), got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or not 0 <= t < vocab_size:
                raise ValueError(f"stop_token_ids: {t!r} is not a token id in [0, {vocab_size})")
        for t, b in self.logit_bias.items():
            if not isinstance(t, int) or not 0 <= t < vocab_size:
                raise ValueError(f"logit_bias: {t!r} is not a token id in [0, {vocab_size})")
            if not isinstance(b, (int, float)) or not math.isfinite(b):
                raise ValueError(f"logit_bias[{t}] must be a finite number, got {b!r}")
        if self.grammar is not None and not callable(getattr(self.grammar, "matcher", None)):
            raise ValueError(f"grammar must be a compiled Grammar (backend.engine.structured), got {self.grammar!r}")
        if self.grammar is not None and self.grammar.vocab_size != vocab_size:
            raise ValueError(f"the grammar was compiled for {self.grammar.vocab_size} token ids, the model has "
                             f"{vocab_size}")
        if self.score_from is not None and (not isinstance(self.score_from, int) or self.score_from < 1):
            raise ValueError(f"score_from must be an integer >= 1 (the first token has no context), got "
                             f"{self.score_from!r}")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5  # below this, logits / T overflows: treat as greedy

    @property
    def needs_history(self) -> bool:
        """Sampling reads the tokens generated so far (repetition, presence or frequency penalty, or a grammar whose
        matcher must have taken the previous token before it can say what the next may be)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.grammar is not None)

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    token_ids: list  # new token ids since the previous output
    logprobs: Optional[list] = None  # per new token: {"token_id", "logprob", "top": [(id, logprob), ...]}
    finished: bool = False
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    error: Optional[str] = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # total so far
    prompt_time_s: float = 0.0  # arrival -> first token
    gen_time_s: float = 0.0  # first token -> this output
    scores: Optional[list] = None  # scoring requests, final output: log P(prompt[i] | prompt[:i]), i >= score_from


_ids = itertools.count()


class Request:
    """One generation request: its token ids, progress, memory and status (the scheduler's noun)."""

    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "params", "seed", "num_computed_tokens",
                 "state_slot", "block_ids", "status", "finish_reason", "error", "arrival_time", "first_token_time",
                 "num_preemptions", "pending_logprobs", "num_sent_tokens", "matcher", "cache_points", "scores",
                 "_prompt_unique")

    def __init__(self, prompt_token_ids, params: SamplingParams, request_id: Optional[str] = None, seed: int = 0,
                 cache_points=()):
        self.request_id = request_id if request_id is not None else f"req-{next(_ids)}"
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list = []
        self.params = params
        # noise for token i of this request is a pure function of (seed, i): independent of the batch
        self.seed = params.seed if params.seed is not None else seed
        self.num_computed_tokens = 0  # tokens whose KV / state is in the caches
        self.state_slot = 0  # KDA slot, 0 = none
        self.block_ids: list = []  # MLA pages, in order
        self.status = RequestStatus.WAITING
        self.finish_reason: Optional[str] = None
        self.error: Optional[str] = None
        self.arrival_time = time.monotonic()
        self.first_token_time: Optional[float] = None
        self.num_preemptions = 0
        self.pending_logprobs: list = []  # logprob entries not yet delivered
        self.num_sent_tokens = 0  # output tokens already delivered to the stream
        # the grammar's state after output_token_ids (llguidance LLMatcher; kept across preemption, since the output
        # tokens are); None without a grammar
        self.matcher = params.grammar.matcher() if params.grammar is not None else None
        # prompt positions (besides its end) where a prefix cache should snapshot, e.g. where a chat's first user
        # message starts: new conversations share what comes before it
        self.cache_points = tuple(sorted({int(p) for p in cache_points if 0 < int(p) < len(self.prompt_token_ids)}))
        # scoring: the log-probability of prompt token score_from + i at [i] once computed (None before); positions
        # recomputed after a preemption write the same entries again
        sf = params.score_from
        self.scores = [None] * (len(self.prompt_token_ids) - sf) if sf is not None else None
        self._prompt_unique = None  # prompt_ids_unique(), made at the first step that needs it

    def score_rows(self, a: int, n: int) -> tuple:
        """Positions in the chunk [a, a + n) whose logits score a prompt token (position p scores token p + 1):
        -> (lo, hi), empty when lo == hi; (0, 0) for a request that generates."""
        if self.scores is None:
            return 0, 0
        lo, hi = max(a, self.params.score_from - 1), min(a + n, len(self.prompt_token_ids) - 1)
        return (lo, hi) if lo < hi else (0, 0)

    def prompt_ids_unique(self):
        """The prompt's distinct token ids, int64 numpy (the repetition penalty's share of each step's host work:
        made once, not per step)."""
        if self._prompt_unique is None:
            self._prompt_unique = np.unique(np.asarray(self.prompt_token_ids, dtype=np.int64))
        return self._prompt_unique

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list:
        return self.prompt_token_ids + self.output_token_ids

    def tokens(self, a: int, n: int) -> list:
        """Tokens [a, a + n) of prompt + output without copying the whole sequence."""
        p = len(self.prompt_token_ids)
        if a + n <= p:
            return self.prompt_token_ids[a:a + n]
        if a >= p:
            return self.output_token_ids[a - p:a - p + n]
        return self.prompt_token_ids[a:] + self.output_token_ids[:a + n - p]

    def token_id(self, i: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def __repr__(self):
        return (f"Request({self.request_id}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens}, slot={self.state_slot}, "
                f"blocks={len(self.block_ids)})")
