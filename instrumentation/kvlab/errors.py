"""kvlab's exceptions, one hierarchy, translated to HTTP/CLI errors at the boundary.

    KvlabError
    ├── ConfigError            a topology, policy or profile file is invalid (message says how to fix)
    ├── RequestError           a client request is invalid -> 400/404 OpenAI-style JSON error
    │   ├── ModelNotFound      unknown model name -> 404
    │   └── PromptTooLong      prompt + max_tokens exceed the model length -> 400
    ├── UpstreamError          a replica failed (connect, status, broken stream)
    │   └── NoEndpointAvailable  no healthy replica to route to -> 503
    ├── StackError             a local process or cluster step failed to start or become healthy
    └── TwinError              a twin run stopped making progress (its watchdog)
"""

from __future__ import annotations


class KvlabError(Exception):
    """Base of every error kvlab raises on purpose."""


class ConfigError(KvlabError):
    """A configuration file or flag is invalid."""


class RequestError(KvlabError):
    """A client request is invalid; rendered as an OpenAI-style JSON error."""

    status = 400
    type = "BadRequestError"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def to_json(self) -> dict[str, dict[str, str | int | None]]:
        """The OpenAI/vLLM error body."""
        return error_body(self.message, self.type, self.status, self.param)


class ModelNotFound(RequestError):
    status = 404
    type = "NotFoundError"


class PromptTooLong(RequestError):
    pass


class TwinError(KvlabError):
    """A twin run whose virtual time stopped advancing: ended with what was seen, never a hang."""


class UpstreamError(KvlabError):
    """A replica failed to answer."""

    def __init__(self, message: str, endpoint: str | None = None, retryable: bool = False) -> None:
        super().__init__(message)
        self.endpoint = endpoint
        self.retryable = retryable


class NoEndpointAvailable(UpstreamError):
    """No healthy replica can take the request."""


class StackError(KvlabError):
    """A process or cluster step of the stack failed."""


def error_body(message: str, type_: str, status: int,
               param: str | None = None) -> dict[str, dict[str, str | int | None]]:
    """The OpenAI/vLLM error body, `{"error": {message, type, param, code}}`: every JSON error kvlab
    answers (client errors, upstream failures, the endpoint picker's own) has this one shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}
