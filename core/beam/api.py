"""``LLM.beam_search``'s arguments and results, in vLLM's shape (``BeamSearchParams``,
``BeamSearchOutput`` of ``BeamSearchSequence``), over the engine's ``SamplingParams.beam_width``."""

from __future__ import annotations

from dataclasses import dataclass, field

from lmplug.errors import ConfigError
from lmplug.interfaces.params import SamplingParams


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True / False / "never", as transformers defines them
    num_return_sequences: int | None = None  # None: all beam_width beams (vLLM returns them all)
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or isinstance(self.beam_width, bool) or self.beam_width < 1:
            raise ConfigError(f"BeamSearchParams.beam_width: expected an integer >= 1, got {self.beam_width!r}")
        n = self.num_return_sequences
        if n is not None and (not isinstance(n, int) or not 1 <= n <= self.beam_width):
            raise ConfigError(f"BeamSearchParams.num_return_sequences: expected an integer in "
                              f"[1, beam_width={self.beam_width}], got {n!r}")
        self.sampling_params()  # every other field is checked where SamplingParams checks it

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            n=self.num_return_sequences or self.beam_width, beam_width=self.beam_width, max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos, length_penalty=self.length_penalty, early_stopping=self.early_stopping,
            min_tokens=self.min_tokens, stop=self.stop, stop_token_ids=list(self.stop_token_ids),
            include_stop_str_in_output=self.include_stop_str_in_output)


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt and output, as vLLM returns them
    output_token_ids: list[int]
    text: str
    cum_logprob: float
    score: float  # cum_logprob / len(output_token_ids) ** length_penalty: what the beams were ranked by
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


def to_beam_output(out) -> BeamSearchOutput:
    """A finished beam request's ``RequestOutput`` as vLLM's ``BeamSearchOutput``."""
    return BeamSearchOutput([BeamSearchSequence(out.prompt_token_ids + c.token_ids, c.token_ids, c.text,
                                                c.cumulative_logprob, c.score, c.finish_reason, c.stop_reason)
                             for c in out.outputs])
