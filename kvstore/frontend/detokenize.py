"""Token ids to text as they stream, with OpenAI's ``stop`` strings.

A token may hold part of a UTF-8 character, and a stop string may span tokens, so the text of
each new token is the difference of decoding the whole output so far; what could still become
a stop string (a suffix that is a prefix of one) is held back until the next token decides.
A stop string ends the request and is not part of the text, as in OpenAI's API.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.workers.model.tokenizer import Tokenizer

#: The replacement character a decoder emits for an unfinished UTF-8 sequence.
_PARTIAL = "\ufffd"


@dataclass(slots=True)
class TextStream:
    """Feeds tokens, hands out text deltas, and says when a stop string was generated."""

    tokenizer: Tokenizer
    stop: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    _text: str = ""  # decoded text of every token so far
    _sent: int = 0  # characters of _text already handed out
    stopped: bool = False

    def push(self, token_id: int) -> str:
        """Add one token; the text that is now final (may be empty)."""
        if self.stopped:
            return ""
        self.token_ids.append(int(token_id))
        text = self.tokenizer.decode(self.token_ids)
        if text.endswith(_PARTIAL):  # the rest of a character is still to come
            return ""
        self._text = text
        for s in self.stop:
            at = self._text.find(s, max(0, self._sent - len(s) + 1))
            if at >= 0:
                self.stopped = True
                delta = self._text[self._sent:at]
                self._sent = at
                self._text = self._text[:at]
                return delta
        hold = self._held_back()
        end = len(self._text) - hold
        if end <= self._sent:
            return ""
        delta = self._text[self._sent:end]
        self._sent = end
        return delta

    def _held_back(self) -> int:
        """Characters at the end that are a proper prefix of some stop string."""
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self._text)), 0, -1):
                if self._text.endswith(s[:k]):
                    longest = max(longest, k)
                    break
        return longest

    def flush(self) -> str:
        """At the end of generation: whatever was held back (no stop string came)."""
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.token_ids) if self.token_ids else ""
        self._text = text
        delta = self._text[self._sent:]
        self._sent = len(self._text)
        return delta

    @property
    def text(self) -> str:
        """The whole output text so far (without a stop string)."""
        return self._text[:self._sent]
