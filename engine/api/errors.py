"""The errors the engine's API raises, as types a caller can map without reading text.

``RequestError`` is the request's own fault (a field out of range, a prompt that
cannot fit, a grammar that allows no token); it names the field in the engine's
terms (``prompt_token_ids``, ``max_tokens``, ...), and its message is written for
the client. ``EngineDeadError`` and ``RequestFailedError`` are the server's side
of a failure: what they say is for the log. The HTTP server turns each into a
status code in one place (``server/http/errors.py``, ``from_engine_error``).
"""

from __future__ import annotations


class RequestError(Exception):
    """A request the engine refuses, or ends, because of what it asked for.

    ``param``: the ``Request`` or ``SamplingParams`` field at fault, or None when
    the request as a whole is (an encoder-only engine given a generation, a
    grammar that reached a state allowing no token). ``message`` does not repeat
    the field's name; ``str()`` puts it in front."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(param, message)  # both in ``args``: it pickles and re-raises intact
        self.param = param
        self.message = message

    def __str__(self) -> str:
        return self.message if self.param is None else f"{self.param}: {self.message}"

    def __repr__(self) -> str:
        return f"RequestError({self.param!r}, {self.message!r})"


class GrammarError(RequestError):
    """A request's grammar cannot be built from its spec, did not compile in time, or
    does not accept the prompt's prefix. ``param``: the API field to name; ``status``:
    400, or 503 when every grammar worker stayed busy past the timeout. Its message is
    the whole client text (it names the field itself)."""

    def __init__(self, message: str, *, param: str, status: int = 400) -> None:
        super().__init__(param, message)
        self.status = status

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[object, ...]:
        return (_grammar_error, (self.message, self.param, self.status))


def _grammar_error(message: str, param: str, status: int) -> GrammarError:
    return GrammarError(message, param=param, status=status)


class EngineDeadError(RuntimeError):
    """The engine stopped (shut down, or a step raised); it takes no more requests."""


class RequestFailedError(RuntimeError):
    """One request failed inside the engine for a reason other than its own input (a bug
    in its mask provider or stop handling); the engine goes on. The cause is chained."""
