"""Incremental detokenization (pdserve.engine.tokenizer.IncrementalDetokenizer): with the
default model's real tokenizer, a stream's text equals ``decode`` of the whole output, over
adversarial token sequences (byte tokens of characters split, lone continuation bytes, lead
bytes never finished, special and added tokens, ids past the vocabulary), and the work per
token stays bounded however long the output runs through partial UTF-8 (counted as the
characters the tokenizer hands back, never timed)."""

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.engine.loader import materialize
from pdserve.engine.tokenizer import IncrementalDetokenizer, TokenBytes, Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(materialize("default", progress=False))


@pytest.fixture(scope="module")
def byte_ids(tok) -> dict[int, int]:
    """byte -> the id of the token that is that byte alone (235 of the 256 have one)."""
    out = {}
    for i in range(len(tok.hf)):
        piece = tok.token_bytes.piece(i)
        if isinstance(piece, bytes) and len(piece) == 1:
            out[piece[0]] = i
    return out


@pytest.fixture(scope="module")
def non_ascii_ids(tok) -> list[int]:
    """Tokens with a byte past ASCII: pieces of multi-byte characters, often not whole ones."""
    return [i for i in range(len(tok.hf)) if any(b >= 0x80 for b in tok.token_bytes.piece(i))]


def stream(tokenizer, ids, stop=()) -> tuple[str, bool]:
    """Every delta of ``ids`` fed one at a time, then the flush; and whether a stop hit."""
    detok = IncrementalDetokenizer(tokenizer, stop)
    out = []
    for t in ids:
        delta, hit = detok.add(t)
        out.append(delta)
        if hit:
            return "".join(out) + detok.flush(), True
    return "".join(out) + detok.flush(), False


def adversarial_ids(tok, byte_ids, non_ascii_ids):
    """Token ids a model may emit, weighted towards the ones that break UTF-8 apart."""
    bytes_ = sorted(byte_ids.values())
    continuation = [byte_ids[b] for b in range(0x80, 0xC0) if b in byte_ids]
    lead = [byte_ids[b] for b in range(0xC0, 0x100) if b in byte_ids]
    special = [i for i, t in tok.hf.added_tokens_decoder.items() if t.special]
    return st.one_of(st.sampled_from(bytes_), st.sampled_from(continuation), st.sampled_from(lead),
                     st.sampled_from(non_ascii_ids), st.sampled_from(special),
                     st.integers(0, len(tok.hf) - 1), st.integers(len(tok.hf), len(tok.hf) + 64))


HYPOTHESIS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def test_the_default_tokenizer_is_detokenized_byte_by_byte(tok):
    assert tok.token_bytes is not None  # else the exact O(1) path below would not be the one served


def test_a_stream_is_decode_of_the_whole_output(tok, byte_ids, non_ascii_ids):
    @HYPOTHESIS
    @given(st.lists(adversarial_ids(tok, byte_ids, non_ascii_ids), max_size=40))
    def check(ids):
        assert stream(tok, ids) == (tok.decode(ids), False)

    check()


def test_a_stream_with_a_stop_string_ends_where_decode_first_holds_it(tok, byte_ids, non_ascii_ids):
    @HYPOTHESIS
    @given(st.lists(adversarial_ids(tok, byte_ids, non_ascii_ids), max_size=40),
           st.sampled_from(["\ufffd", "\ufffd\ufffd", "a", "\u20ac", "\ufffd<"]))
    def check(ids, stop):
        whole = tok.decode(ids)
        text, hit = stream(tok, ids, (stop,))
        # (a stop string the last, unfinished character makes is cut at the flush: the output
        # had ended already, so no hit is reported)
        assert text == whole.split(stop)[0] and (stop in whole if hit else stop not in whole[:-1])

    check()


@pytest.mark.parametrize("name,pieces", [
    ("lone continuation bytes", [0x80] * 300),
    ("lead bytes never finished", [0xF0, 0x9F] * 150),
    ("a 4-byte character split byte by byte", [0xF0, 0x9F, 0x98, 0x80] * 75),
    ("finished characters between broken ones", [0xE2, 0x82, 0xAC, 0x80, 0xE2, 0x82] * 50),
    ("an unfinished character at the very end", [0x41, 0xE4, 0xB8]),
])
def test_split_characters_stream_as_decode_has_them(tok, byte_ids, name, pieces):
    ids = [byte_ids[b] for b in pieces]
    assert stream(tok, ids) == (tok.decode(ids), False), name


@pytest.mark.parametrize("pieces", [[0xED, 0xA1], [0xE0, 0x80], [0xF0, 0x8F], [0xF4, 0x90, 0x80]])
def test_bytes_no_byte_can_finish_are_settled_at_once(tok, byte_ids, pieces):
    """A lead byte and a second byte outside its range (a surrogate, an overlong form, past
    U+10FFFF) can never be one character: their U+FFFD come out, and a stop string they make
    hits, before the output ends (hypothesis found ED A1 held to the flush, its hit lost)."""
    ids = [byte_ids[b] for b in pieces]
    assert stream(tok, ids) == (tok.decode(ids), False)
    detok = IncrementalDetokenizer(tok, ("\ufffd",))
    assert [detok.add(t) for t in ids][-1] == ("", True)


def test_an_added_token_that_is_not_special_ends_the_bytes_before_it(tok, byte_ids):
    hf = copy.deepcopy(tok.hf)
    hf.add_tokens(["<tool_x>"])
    added = Tokenizer.__new__(Tokenizer)
    added.hf, added.token_bytes = hf, TokenBytes.of(hf)
    [tool_x] = hf.convert_tokens_to_ids(["<tool_x>"])
    ids = [byte_ids[0xE2], tool_x, byte_ids[0x82], byte_ids[0xAC], 1, byte_ids[0x41]]
    assert stream(added, ids) == (hf.decode(ids, skip_special_tokens=True), False) == ("\ufffd<tool_x>\ufffd\ufffdA", False)


class CountingHF:
    """The real tokenizer, counting the characters its calls hand back: the work a
    detokenizer makes it do (decoding a window of n tokens hands back ~n characters)."""

    def __init__(self, hf):
        self._hf, self.chars = hf, 0

    def __getattr__(self, name):
        attr = getattr(self._hf, name)
        if not callable(attr):
            return attr

        def counted(*args, **kwargs):
            out = attr(*args, **kwargs)
            self.chars += sum(len(s) for s in (out if isinstance(out, list) else [out]) if isinstance(s, str))
            return out

        return counted


def chars_per_token(tok, ids) -> float:
    counting = Tokenizer.__new__(Tokenizer)
    counting.hf = CountingHF(tok.hf)
    counting.token_bytes = TokenBytes.of(counting.hf)
    stream(counting, ids)
    return counting.hf.chars / len(ids)


@pytest.mark.parametrize("piece", [0x80, 0xF0])  # never a character: each token leaves U+FFFD pending or final
def test_work_per_token_stays_bounded_through_partial_utf8(tok, byte_ids, piece):
    short, long = (chars_per_token(tok, [byte_ids[piece]] * n) for n in (256, 4096))
    assert long <= 4 and long <= short + 1, (short, long)


class ByteTokenizer:
    """Any tokenizer without byte-level pieces: one token is one byte, decoded as UTF-8 with
    U+FFFD, as SentencePiece's byte fallback tokens are; counts the characters it decodes."""

    def __init__(self):
        self.chars = 0

    def decode(self, ids) -> str:
        text = bytes(ids).decode("utf-8", errors="replace")
        self.chars += len(text)
        return text


def test_the_window_path_stays_bounded_and_streams_whole_characters():
    tokenizer = ByteTokenizer()
    text, _ = stream(tokenizer, list("€ and 😀 then Ä".encode()))
    assert text == "€ and 😀 then Ä"
    work = []
    for n in (256, 4096):
        tokenizer.chars = 0
        assert stream(tokenizer, [0x80] * n)[0] == "\ufffd" * n
        work.append(tokenizer.chars / n)
    assert work[1] <= 16 and work[1] <= work[0] + 1, work
