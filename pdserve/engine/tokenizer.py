"""Tokenizer, chat template and incremental detokenization (with stop strings)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

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


class IncrementalDetokenizer:
    """Turns a growing list of output tokens into text deltas, applying stop strings.

    Decodes only a short window (the tokens since the last emitted boundary) so each step
    costs O(1), and holds text back while the window ends in an incomplete UTF-8 sequence.
    With stop strings, the last ``max(len(stop)) - 1`` characters are also held back, so a
    stop string is never partly streamed before it is recognised; ``flush`` emits them.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()):
        self.tok = tokenizer
        self.stop = tuple(stop)
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self._emitted = 0  # characters of self.text already returned
        self._prefix = 0  # window start
        self._read = 0  # tokens already turned into text

    def add(self, token_id: int) -> tuple[str, bool]:
        """Append a token; return (new text to emit, whether a stop string ended the output)."""
        self.ids.append(token_id)
        prefix_text = self.tok.decode(self.ids[self._prefix:self._read])
        full = self.tok.decode(self.ids[self._prefix:])
        if full.endswith("\ufffd") or len(full) <= len(prefix_text):
            return "", False
        before = len(self.text)
        self.text += full[len(prefix_text):]
        self._prefix, self._read = self._read, len(self.ids)
        if self.stop:
            search_from = max(0, before - self._holdback)
            hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[:min(hits)]
                return self.flush(), True
        end = len(self.text) - self._holdback
        if end <= self._emitted:
            return "", False
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta, False

    def flush(self) -> str:
        """Return whatever text is still held back (call once the sequence has finished)."""
        delta = self.text[self._emitted:]
        self._emitted = len(self.text)
        return delta
