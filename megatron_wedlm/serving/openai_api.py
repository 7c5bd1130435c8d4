"""The OpenAI request bodies the server takes, and how each becomes decoding settings.

Fields are OpenAI's; an unknown field is refused (400), and one this server cannot honour is
refused with the reason unless at its neutral value. WeDLM's knobs are extra fields
(docs/serving.md, "Request fields"); what a request leaves out comes from the model's stored
defaults (:mod:`megatron_wedlm.decoding.options`), then the built-in ones.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from megatron_wedlm.decoding.settings import METHODS, DecodeSettings

#: the most top tokens per position a request may ask for (``logprobs``), vLLM's default ``max_logprobs``
MAX_LOGPROBS = 20


class BadRequest(ValueError):
    """A request the server refuses with 400; ``param`` names the field at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class _Knobs(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, bool] | None = None
    n: int = 1
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    method: Literal[METHODS] | None = None  # type: ignore[valid-type]
    window_size: int | None = Field(None, ge=1)
    entropy_threshold: float | None = None
    distance_penalty: float | None = Field(None, ge=0)
    ignore_eos: bool = False  # vLLM's: decode to max_tokens past the stop tokens (benchmarks)

    def check_supported(self) -> None:
        """Refuse what this server cannot do, naming the field."""
        if self.n != 1:
            raise BadRequest("n > 1 is not supported: send the request n times (with different seeds)", "n")
        self._check_logprobs()
        if self.presence_penalty or self.frequency_penalty:
            raise BadRequest("presence and frequency penalties are not supported", "presence_penalty")
        if self.logit_bias:
            raise BadRequest("logit_bias is not supported", "logit_bias")

    def _check_logprobs(self) -> None:
        if self.logprobs not in (None, False, 0):
            raise BadRequest("logprobs are not supported on chat completions; /v1/completions returns them "
                             f"(logprobs: 0 to {MAX_LOGPROBS}, with echo: true for the prompt's)", "logprobs")

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def settings(self, defaults: dict[str, Any], stop_token_ids: list[int], max_new_tokens: int) -> DecodeSettings:
        """The decoding settings of this request: its fields, else ``defaults`` (the model's, then built-in)."""
        given = {"window_size": self.window_size, "distance_penalty": self.distance_penalty, "method": self.method}
        values = {**defaults, **{k: v for k, v in given.items() if v is not None}}
        if "entropy_threshold" in self.model_fields_set:  # an explicit null: one slot per forward
            values["entropy_threshold"] = self.entropy_threshold
        try:
            return DecodeSettings.build(
                **values, max_new_tokens=max_new_tokens,
                temperature=0.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
                stop_token_ids=() if self.ignore_eos else stop_token_ids, stop_strings=self.stop_strings(),
            )
        except (TypeError, ValueError) as error:
            raise BadRequest(str(error)) from None


class CompletionRequest(_Knobs):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, token ids, or lists of them."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def _check_logprobs(self) -> None:
        value = self.logprobs
        if value is None or value is False:
            return
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
            raise BadRequest(f"logprobs must be an integer from 0 to {MAX_LOGPROBS} (the most likely tokens "
                             f"reported per position, besides the token itself), or null; got {value!r}",
                             "logprobs")

    @property
    def logprobs_top_n(self) -> int | None:
        """How many top tokens to report per position, None for no ``logprobs`` object."""
        return None if self.logprobs is None or self.logprobs is False else int(self.logprobs)

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens == 0 and not self.echo:
            raise BadRequest("max_tokens 0 returns the prompt alone: it needs echo: true (with logprobs: N, the "
                             "prompt's log-probabilities)", "max_tokens")
        if self.best_of not in (None, 1):
            raise BadRequest("best_of > 1 is not supported", "best_of")
        if self.suffix:
            raise BadRequest("suffix (insertion) is not supported", "suffix")

    def prompts(self) -> list[str | list[int]]:
        """One item per prompt of the request: text, or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise BadRequest("prompt is empty", "prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A message; ``content`` may be a string or a list of text parts (images are not served)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_input(self) -> dict[str, str]:
        content = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": self.role, "content": content}


class ChatRequest(_Knobs):
    """``POST /v1/chat/completions``: ``messages`` go through the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def finish_reason(stop_reason: str) -> str:
    """OpenAI's ``finish_reason`` of a :class:`GenerationResult` ``stop_reason``."""
    return "length" if stop_reason in ("max_new_tokens", "max_positions") else "stop"
