"""The HTTP bodies of the OpenAI-compatible API, as pydantic models.

Requests take what OpenAI clients send; fields that would change an answer in a way this server
cannot honour (several choices, stop sequences) are refused rather than ignored. Retrieval is
the `rag` extension field: without it a request is a plain completion.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, model_validator

# a JSON integer or boolean as such: `"max_tokens": true` or `"8"` is a client's mistake, not 1
# or 8 (pydantic's lax mode converts both)
Whole = Annotated[int, Strict()]
Flag = Annotated[bool, Strict()]
Number = Annotated[float, Strict()]  # (a JSON integer is one too)

# OpenAI fields this server cannot honour, with the values that ask nothing of it (what
# clients send by default): any other value is refused, not silently ignored
UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "stop": (None, []),  # stop sequences
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),  # (with no tools, "auto" chooses none)
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
}


class RagOptions(BaseModel):
    """What to answer over: `cache_ids` (chunks, in order) or the `top_k` chunks retrieved for
    the question; `strategy` how to link them (default: the server's)."""

    model_config = ConfigDict(extra="forbid")

    top_k: Whole | None = Field(None, ge=1, le=64)
    cache_ids: list[str] | None = Field(None, max_length=256)
    strategy: str | None = Field(None, max_length=200)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    include_usage: Flag | None = None


class Sampling(BaseModel):
    """What both endpoints share: the model, length, sampling, streaming and RAG."""

    model: str | None = None
    max_tokens: Whole | None = Field(None, ge=1)
    temperature: Number | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: Number | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    seed: Whole | None = None
    n: Whole | None = Field(None, ge=1, le=1, description="one choice per request")
    stream: Flag | None = None  # null, as OpenAI's API allows, is false
    stream_options: StreamOptions | None = None
    rag: RagOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, harmless in UNSUPPORTED.items():
                if name in data and not any(_same(data[name], h) for h in harmless):
                    raise ValueError(f"{name} is not supported by this server")
        return data


def _same(value: object, harmless: object) -> bool:
    """Equal, with booleans apart from numbers: completions' `logprobs: 0` asks for the
    sampled token's log probability, where chat's `logprobs: false` asks for nothing."""
    if isinstance(value, bool) or isinstance(harmless, bool):
        return value is harmless
    return value == harmless


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Whole | None = Field(None, ge=1)


class CompletionRequest(Sampling):
    prompt: str | list[str]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class RagUsage(BaseModel):
    """What the cache did for this answer (the response's extension field)."""

    cache_ids: list[str]
    strategy: str
    context_tokens: int
    reused_tokens: int  # taken already linked from the prefix tree
    recomputed_tokens: int
    ttft_s: float
