"""Tokenizer, chat template and incremental detokenization (with stop strings)."""

from __future__ import annotations

import codecs
from pathlib import Path
from typing import Protocol, Sequence

from pdserve.engine.errors import ModelLoadError


class Tokenizer:
    """Thin wrapper over a ``transformers`` fast tokenizer saved beside the weights."""

    def __init__(self, model_dir: Path | str, chat_template: str | None = None):
        """``chat_template``: a Jinja template, or a file holding one, that replaces the
        tokenizer's own (``pdserve serve --chat-template``)."""
        from transformers import AutoTokenizer

        try:
            self.hf = AutoTokenizer.from_pretrained(str(model_dir))
        except Exception as exc:  # transformers raises OSError/ValueError/... for a bad dir
            raise ModelLoadError(str(model_dir), f"cannot load tokenizer ({exc})") from exc
        if chat_template is not None:
            self.hf.chat_template = read_chat_template(chat_template)
        # Each token's bytes, when decoding is byte-level: output is then detokenized exactly
        # and in O(1) a token (IncrementalDetokenizer); None for other tokenizers.
        self.token_bytes = TokenBytes.of(self.hf)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=True)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> list[int]:
        """``tools``: OpenAI's tool list, for templates that render it (others ignore it)."""
        if not self.hf.chat_template:
            raise ValueError("this model has no chat template; send plain text or token ids")
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           tools=tools or None)
        return self.hf.encode(text, add_special_tokens=False)


def read_chat_template(value: str) -> str:
    """The template itself: ``value`` names a file (read it) or is the Jinja text (as
    ``vllm serve --chat-template`` takes either). Raises ValueError naming chat_template."""
    if "{" in value:  # Jinja text always has a tag or an expression
        return value
    try:
        return Path(value).read_text()
    except OSError as exc:
        raise ValueError(f"chat_template: cannot read {value!r} ({exc.strerror})") from exc


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a byte is written as inside a
    token -> that byte (printable Latin-1 bytes stand for themselves, the rest are shifted
    past 255)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(shifted)}
    return {c: b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_alphabet()


class TokenBytes:
    """Each token's bytes, for a byte-level BPE tokenizer (GPT-2's scheme: SmolLM2, Llama 3,
    Qwen2). Its ``decode`` is the UTF-8 of its tokens' bytes joined, each maximal invalid run
    one U+FFFD, which is what an incremental UTF-8 decoder fed one token at a time gives too:
    so a stream is detokenized exactly as ``decode`` of the whole output, never looking at a
    byte twice.

    A special token adds nothing (``decode`` skips them); an added token that is not special
    adds its own text and ends the bytes before it (``tokenizers`` decodes the runs between
    added tokens apart, then joins them). Each token's bytes are looked up once."""

    def __init__(self, hf):
        added = hf.added_tokens_decoder  # id -> AddedToken
        self._skipped = frozenset(i for i, t in added.items() if t.special)
        self._added = {i: t.content for i, t in added.items() if not t.special}
        self._hf = hf
        self._pieces: dict[int, bytes] = {}

    @staticmethod
    def of(hf) -> TokenBytes | None:
        """For ``hf`` if it is a fast tokenizer whose decoder is byte-level with nothing after
        it (``clean_up_tokenization_spaces`` rewrites text across tokens); else None."""
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None or getattr(hf, "clean_up_tokenization_spaces", False):
            return None
        return TokenBytes(hf) if type(backend.decoder).__name__ == "ByteLevel" else None

    def piece(self, token_id: int) -> bytes | str:
        """The token's bytes (none for a special token or an id outside the vocabulary), or
        the text of an added token that is not special."""
        if token_id in self._added:
            return self._added[token_id]
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self._lookup(token_id)
        return piece

    def _lookup(self, token_id: int) -> bytes:
        if token_id in self._skipped:
            return b""
        token = self._hf.convert_ids_to_tokens(token_id)
        if token is None:
            return b""
        try:
            return bytes(_BYTE_OF_CHAR[c] for c in token)
        except KeyError:  # a character outside the byte alphabet: tokenizers takes the token as UTF-8
            return token.encode()


class _TextSource(Protocol):
    def add(self, token_id: int) -> str:
        """The text this token settles (maybe none yet)."""

    def finish(self) -> str:
        """The text still held at the output's end."""


class _Utf8Text:
    """Exact and O(1) a token: an incremental UTF-8 decoder over each token's bytes, which
    holds at most the 3 bytes of one unfinished character (``TokenBytes``)."""

    def __init__(self, token_bytes: TokenBytes):
        self._bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, token_id: int) -> str:
        piece = self._bytes.piece(token_id)
        if isinstance(piece, str):  # an added token's text: the bytes before it end here
            return self.finish() + piece
        text = self._utf8.decode(piece)
        if not _can_finish(self._utf8.getstate()[0]):
            # Python's decoder holds a lead byte and a second byte outside that lead's range
            # (ED A1: a surrogate) until more bytes come, though no byte can finish them: their
            # U+FFFD are settled now, whatever follows, and a stop string they make hits now.
            text += self.finish()
        return text

    def finish(self) -> str:
        return self._utf8.decode(b"", final=True)  # an unfinished character is U+FFFD, as decode has it


# The second byte a UTF-8 lead byte allows where it is not the whole 80-BF range (RFC 3629):
# no overlong forms, no surrogates, nothing past U+10FFFF.
_SECOND_BYTE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


def _can_finish(held: bytes) -> bool:
    """Whether the bytes an incremental decoder holds can still begin one valid character."""
    if len(held) < 2:
        return True
    low, high = _SECOND_BYTE.get(held[0], (0x80, 0xBF))
    return low <= held[1] <= high


class _WindowText:
    """Any tokenizer with a ``decode``: decodes a short window (the tokens since the last
    boundary text was taken at) and holds text back while the window ends in U+FFFD, an
    incomplete UTF-8 sequence. Held for more than ``MAX_PENDING`` tokens, the text is taken
    as it is, as a streaming UTF-8 decoder gives up on a sequence longer than a character:
    so no window grows past a few tokens, and each token costs O(1) decoding."""

    MAX_PENDING = 4  # tokens: a character is at most 4 bytes, each byte token adds one

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._window: list[int] = []
        self._read = 0  # the window's first tokens, whose text was taken already

    def add(self, token_id: int) -> str:
        self._window.append(token_id)
        prefix = self.tok.decode(self._window[:self._read])
        full = self.tok.decode(self._window)
        held = full.endswith("\ufffd") or len(full) <= len(prefix)
        if held and len(self._window) - self._read <= self.MAX_PENDING:
            return ""
        self._window = self._window[self._read:]
        self._read = len(self._window)
        return full[len(prefix):]

    def finish(self) -> str:
        if self._read == len(self._window):
            return ""
        return self.tok.decode(self._window)[len(self.tok.decode(self._window[:self._read])):]


class IncrementalDetokenizer:
    """Turns a growing list of output tokens into text deltas, applying stop strings.

    Each token costs O(1), however long the output and whatever bytes it holds: a
    ``Tokenizer`` with byte-level decoding is decoded exactly as ``decode`` of the whole output
    would (``TokenBytes``), any other through a short window (``_WindowText``). Text that an
    incomplete UTF-8 sequence may still change is held back; ``flush`` gives what is left,
    an unfinished last character as U+FFFD. With stop strings, the last ``max(len(stop)) - 1``
    characters are also held back, so a stop string is never partly streamed before it is
    recognised; only those are kept, never the whole text.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.stop = tuple(stop)
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        token_bytes = tokenizer.token_bytes if isinstance(tokenizer, Tokenizer) else None
        self._source: _TextSource = _Utf8Text(token_bytes) if token_bytes is not None else _WindowText(tokenizer)
        self._unsent = ""  # text decoded and not returned yet: the holdback and the last token's text
        self._stopped = False

    def add(self, token_id: int) -> tuple[str, bool]:
        """Append a token; return (new text to emit, whether a stop string ended the output)."""
        return self._take(self._source.add(token_id))

    def flush(self) -> str:
        """Return whatever text is still held back (call once the sequence has finished)."""
        delta = "" if self._stopped else self._take(self._source.finish())[0]
        rest, self._unsent = self._unsent, ""
        return delta + rest

    def _take(self, new: str) -> tuple[str, bool]:
        if not new:
            return "", False
        self._unsent += new
        if self.stop:
            hits = [i for i in (self._unsent.find(s) for s in self.stop) if i >= 0]
            if hits:
                text, self._unsent, self._stopped = self._unsent[:min(hits)], "", True
                return text, True
        end = len(self._unsent) - self._holdback
        if end <= 0:
            return "", False
        delta, self._unsent = self._unsent[:end], self._unsent[end:]
        return delta, False
