"""What the engine keeps of one request between ``add_request`` and its end: one record.

The scheduler owns the ``Sequence`` (tokens, status, blocks through the block manager); the
engine adds what only it needs: the incremental detokenizer, and where a structured request
stands between its grammar's compile (off the engine thread) and its KV's arrival. Forgetting a
request is dropping its record (``LLMEngine._forget``), so nothing is left behind in a map of
its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.errors import SequenceFailed
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.tokenizer import IncrementalDetokenizer


@dataclass
class RequestState:
    seq: Sequence
    detok: IncrementalDetokenizer | None  # None: the engine does not detokenize, or the request is HELD
    # A structured request whose KV landed while its grammar compiles: it joins the decode batch
    # with its grammar (``LLMEngine._admit_compiled``).
    kv_landed: bool = False
    # A structured request whose grammar failed before its KV landed: its blocks are still being
    # written, so it ends on ``kv_ready``, with this error.
    unfit: SequenceFailed | None = None

    def text_of(self, tokens: list[int], seq: Sequence) -> tuple[str, bool]:
        """The text of ``seq``'s new ``tokens`` ("" without a detokenizer), and whether a stop
        string ended it (the rest of its text is then cut, and never flushed); a sequence that
        ended otherwise flushes what its detokenizer held back."""
        if self.detok is None:
            return "", False
        text = ""
        for token in tokens:
            piece, hit_stop = self.detok.add(token)
            text += piece
            if hit_stop:
                return text, True
        return text + (self.detok.flush() if seq.is_finished else ""), False
