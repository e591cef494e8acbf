"""What ``generate`` returns: one ``RequestOutput`` per prompt, one ``CompletionOutput`` per sample."""

from __future__ import annotations

from dataclasses import dataclass, field

from lmplug.interfaces.compressor import CompressionReport
from lmplug.interfaces.sequence import Logprob


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    # beam search: the summed logprob of the tokens, and the length-penalised score it was ranked by
    cumulative_logprob: float | None = None
    score: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    # speculative decoding, over the request's sequences: draft tokens verified, and accepted
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    # target forwards (engine steps) that produced tokens for the request (with n > 1: the most
    # of any of its sequences, which step together); without speculation one per token
    num_target_forwards: int = 0
    # the speculative acceptance rule that decided the tokens (None: no speculation) and whether it
    # is lossy (its tokens may depart from the target distribution: ``lmplug.interfaces.acceptance``)
    acceptance_rule: str | None = None
    lossy: bool = False

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_drafted_tokens if self.num_drafted_tokens else None

    def tokens_per_forward(self, num_tokens: int) -> float | None:
        """``num_tokens`` generated (e.g. ``len(output.token_ids)``) per target forward."""
        return num_tokens / self.num_target_forwards if self.num_target_forwards else None

    def spec_summary(self, num_tokens: int) -> str:
        """One line: drafted, accepted, acceptance rate, target forwards, tokens per forward."""
        rate = self.acceptance_rate
        per = self.tokens_per_forward(num_tokens)
        return (f"drafted {self.num_drafted_tokens}, accepted {self.num_accepted_tokens} "
                f"({'-' if rate is None else f'{100 * rate:.0f}%'}), target forwards "
                f"{self.num_target_forwards}, tokens/forward {'-' if per is None else f'{per:.2f}'}")

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: RequestMetrics | None = None
    delta_text: str = ""  # streaming: text added since the previous output of this request
    delta_token_ids: list[int] = field(default_factory=list)
    # prompt compression (``LLM.generate(..., compression=...)``): tokens before/after, method, seconds
    compression: CompressionReport | None = None

    # The first sample's fields, for the common n == 1 case.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def logprobs(self) -> list[dict[int, Logprob]] | None:
        return self.outputs[0].logprobs

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
