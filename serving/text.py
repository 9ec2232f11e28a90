"""Generated tokens → the text a client sees, one step at a time, with OpenAI's `stop`.

The decoder (`EngineTokenizer.stream_decoder`) already holds back a character split over
several tokens. A stop string may still arrive over several steps, so the last
`len(longest stop) - 1` characters are held back until they cannot begin one.
"""

from __future__ import annotations

from collections.abc import Callable


class TextStream:
    """The continuation's text so far, released in deltas that never need taking back."""

    def __init__(self, step: Callable[[int], str | None], stop: tuple[str, ...] = ()) -> None:
        self._step = step
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._text = ""
        self._released = 0
        self.stopped = False

    def add(self, token: int) -> str:
        """Take one generated token; return the text it releases (maybe empty). After a stop
        string appears, `stopped` is true and the text ends just before it."""
        piece = self._step(token)
        if not piece:
            return ""
        self._text += piece
        cut = self._first_stop()
        if cut is not None:
            self._text, self.stopped = self._text[:cut], True
            return self._release(len(self._text))
        return self._release(max(self._released, len(self._text) - self._hold))

    def finish(self) -> str:
        """The rest of the text once generation has ended for any reason."""
        return self._release(len(self._text))

    @property
    def text(self) -> str:
        return self._text[: self._released]

    def _first_stop(self) -> int | None:
        if not self._stop:
            return None
        # Only the unreleased tail (plus the held-back overlap) can hold a new stop string.
        start = max(0, self._released - self._hold)
        hits = [i for i in (self._text.find(s, start) for s in self._stop) if i >= 0]
        return min(hits) if hits else None

    def _release(self, upto: int) -> str:
        delta = self._text[self._released : upto]
        self._released = max(self._released, upto)
        return delta
