"""Token chunk batching: many engine deltas become one ``TokenChunk`` on Kafka.

A chunk is flushed when it holds ``max_tokens`` tokens, when its oldest token has waited
``max_delay_s``, or when adding the next text would pass ``max_chars`` (the wire limit of one
chunk). So at 16 tokens / 50 ms Kafka carries about 16x fewer messages than tokens under
load, and an idle stream still shows text within 50 ms. The caller asks :meth:`due_at`
when it must wake up to flush a chunk whose time ran out without a new token.

``seq`` numbers chunks of one attempt from 0 (clients drop duplicate ``(attempt, seq)``).

No chunk passes the wire's limits (``max_chars`` characters, ``max_chunk_tokens`` tokens,
both ``schemas.base.MAX_CHUNK_CHARS`` by default): :meth:`ChunkBatcher.add_all` splits a
delta past either into consecutive pieces (an engine may count tens of thousands of
reasoning tokens on one short text delta). Each piece carries at least one token (a chunk
must), so a delta of more characters per token than a chunk holds is counted a few tokens
high in its chunks, and so is text left without a token at the stream's end (a chunk of
one); the ``Done``'s usage is the engine's own count.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.base import MAX_CHUNK_CHARS


@dataclass(frozen=True, slots=True)
class Chunk:
    """A batch of consecutive output: ``tokens`` tokens of ``text``, the ``seq``-th chunk."""

    seq: int
    text: str
    tokens: int


class ChunkBatcher:
    """Accumulates deltas of one request; ``add`` / ``flush`` return a chunk when one is due."""

    def __init__(self, max_tokens: int = 16, max_delay_s: float = 0.05,
                 max_chars: int = MAX_CHUNK_CHARS,
                 max_chunk_tokens: int = MAX_CHUNK_CHARS) -> None:
        if max_tokens < 1 or max_delay_s < 0 or max_chars < 1 or max_chunk_tokens < 1:
            raise ValueError("max_tokens, max_chars and max_chunk_tokens must be >= 1, "
                             "max_delay_s >= 0")
        self.max_tokens = max_tokens
        self.max_delay_s = max_delay_s
        self.max_chars = max_chars
        self.max_chunk_tokens = max_chunk_tokens
        self._parts: list[str] = []
        self._chars = 0
        self._tokens = 0
        self._since: float | None = None  # time of the oldest pending token
        self._seq = 0
        self.chunks = 0
        self.total_tokens = 0

    @property
    def pending_tokens(self) -> int:
        return self._tokens

    def due_at(self) -> float | None:
        """When the pending chunk must be flushed; None when nothing is pending."""
        return None if self._since is None else self._since + self.max_delay_s

    def add(self, text: str, tokens: int, now: float) -> Chunk | None:
        """Take a delta. Returns the chunk to send when one became due, else None.

        A delta that would overflow ``max_chars`` flushes the pending text first and starts
        the next chunk (the returned chunk never holds more than ``max_chars`` unless a single
        delta is itself that long). Deltas of 0 tokens and no text are ignored.
        """
        if tokens < 0:
            raise ValueError("tokens must be >= 0")
        if tokens == 0 and not text:
            return None
        out: Chunk | None = None
        if self._tokens and (self._chars + len(text) > self.max_chars
                             or self._tokens + tokens > self.max_chunk_tokens):
            out = self._take()
        self._parts.append(text)
        self._chars += len(text)
        self._tokens += tokens
        if self._since is None and tokens > 0:
            self._since = now
        if out is None and (self._tokens >= self.max_tokens or self._expired(now)):
            out = self._take()
        return out

    def add_all(self, text: str, tokens: int, now: float) -> list[Chunk]:
        """Take a delta of any size: the chunks now due, none past the wire's limits (the
        module docstring says how a delta past them is split)."""
        if tokens < 0:
            raise ValueError("tokens must be >= 0")
        pieces = max(-(-tokens // self.max_chunk_tokens), -(-len(text) // self.max_chars))
        if pieces <= 1:
            chunk = self.add(text, tokens, now)
            return [] if chunk is None else [chunk]
        width = -(-len(text) // pieces)
        out: list[Chunk] = []
        for i in range(pieces):
            # Tokens spread evenly (each piece <= the limit), at least one per piece.
            share = max(1, tokens // pieces + (1 if i < tokens % pieces else 0))
            chunk = self.add(text[i * width:(i + 1) * width], share, now)
            if chunk is not None:
                out.append(chunk)
            if self._tokens >= self.max_tokens:
                out.append(self._take())
        return out

    def flush(self, now: float, force: bool = False) -> Chunk | None:
        """The pending chunk if its time ran out (or ``force``), else None. Forced (the
        stream's end), text that no token came with goes as a chunk of one token rather
        than be lost (an engine's last text may come with its count already given)."""
        if force and self._tokens == 0 and self._chars:
            self._tokens = 1
        if self._tokens == 0 or not (force or self._expired(now)):
            return None
        return self._take()

    def _expired(self, now: float) -> bool:
        return self._since is not None and now >= self._since + self.max_delay_s

    def _take(self) -> Chunk:
        # Only called with tokens pending: text without tokens cannot be a chunk (tokens >= 1
        # on the wire), so such text waits for the next token instead.
        chunk = Chunk(self._seq, "".join(self._parts), self._tokens)
        self._seq += 1
        self.chunks += 1
        self.total_tokens += self._tokens
        self._parts, self._chars, self._tokens, self._since = [], 0, 0, None
        return chunk
