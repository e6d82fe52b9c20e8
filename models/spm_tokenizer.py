"""SentencePiece-style tokenizers (`tokenizer.ggml.model` "llama": Llama 2, Mistral, TinyLlama) as
llama.cpp tokenizes them from the GGUF file alone (src/llama-vocab.cpp, llm_tokenizer_spm).

Encoding: control and user-defined tokens written in the text are cut out whole first; each
stretch of text between them gets a leading space when it starts the text or follows such a
token (`tokenizer.ggml.add_space_prefix`, on by default), its spaces become "▁", and its
characters are merged pairwise, always the adjacent pair whose join is the vocabulary's token of
the highest score (the leftmost on a tie), until no join is a token. A character no token holds
is written as its UTF-8 bytes' tokens (`<0xE2>`...: byte fallback). BOS first when the file says
so (`tokenizer.ggml.add_bos_token`, on by default for these vocabularies).

Decoding: "▁" is a space again, byte tokens are bytes (joined, then read as UTF-8), control and
unknown tokens are dropped with `skip_special` and written as their text otherwise, unused ones
dropped; the space the encoding put in front is taken off the first piece, unless the ids
continue a text (`continuation`: a generation's tokens, whose first word's space belongs to it).

tests/test_llama_cpp_vocab.py holds it to llama.cpp's own test vectors (ggml-vocab-llama-spm).
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass, field

from models.tokenizer import TokenType

SPACE = "\u2581"  # "▁": SentencePiece's space
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass
class SentencePieceTokenizer:
    tokens: list[str]
    scores: list[float]
    types: list[int]
    add_bos: bool
    bos: int
    add_space_prefix: bool = True
    add_eos: bool = False
    eos: int = -1
    unknown: int = -1
    ids: dict[str, int] = field(init=False, repr=False)
    special: re.Pattern | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.ids = {text: i for i, text in enumerate(self.tokens)}  # the last of duplicates, as llama.cpp's map
        cut_out = (TokenType.CONTROL, TokenType.USER_DEFINED)
        whole = {t for t, kind in zip(self.tokens, self.types) if kind in cut_out and t}
        whole = sorted(whole, key=len, reverse=True)  # the longest first where two start alike
        self.special = re.compile("|".join(map(re.escape, whole))) if whole else None

    # -- encoding ---------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        out = [self.bos] if self.add_bos and self.bos >= 0 else []
        after_special = True  # the text's start counts as following one
        for piece, token in self._fragments(text):
            if token is not None:
                out.append(token)
                after_special = True
                continue
            if self.add_space_prefix and after_special:
                piece = " " + piece
            self._merge(piece.replace(" ", SPACE), out)
            after_special = False
        if self.add_eos and self.eos >= 0:
            out.append(self.eos)
        return out

    def _fragments(self, text: str):
        """(text, None) for a stretch of plain text, (None, id) for a whole special token."""
        at = 0
        for found in self.special.finditer(text) if self.special is not None else ():
            if found.start() > at:
                yield text[at : found.start()], None
            yield None, self.ids[found.group()]
            at = found.end()
        if at < len(text):
            yield text[at:], None

    def _merge(self, text: str, out: list[int]) -> None:
        """llm_tokenizer_spm_session::tokenize: the best-scored joins of adjacent symbols."""
        count = len(text)
        if not count:
            return
        start = list(range(count))
        size = [1] * count
        prev = [i - 1 for i in range(count)]
        nxt = [i + 1 if i + 1 < count else -1 for i in range(count)]
        queue: list[tuple[float, int, int, int]] = []  # (-score, left, right, joined size): best first
        rev_merge: dict[str, tuple[int, int]] = {}

        def offer(left: int, right: int) -> None:
            if left == -1 or right == -1:
                return
            joined = text[start[left] : start[left] + size[left] + size[right]]
            token = self.ids.get(joined)
            if token is None:
                return
            heapq.heappush(queue, (-self.scores[token], left, right, len(joined)))
            rev_merge[joined] = (left, right)

        for i in range(1, count):
            offer(i - 1, i)
        while queue:
            _, left, right, joined = heapq.heappop(queue)
            if size[left] == 0 or size[right] == 0 or size[left] + size[right] != joined:
                continue  # one of them was merged since
            size[left] += size[right]
            size[right] = 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            offer(prev[left], left)
            offer(left, nxt[left])

        def resegment(symbol: int) -> None:
            piece = text[start[symbol] : start[symbol] + size[symbol]]
            token = self.ids.get(piece)
            if token is not None:
                out.append(token)
                return
            pair = rev_merge.get(piece)
            if pair is None:
                out.extend(self._byte_token(b) for b in piece.encode("utf-8"))
                return
            resegment(pair[0])
            resegment(pair[1])

        i = 0
        while i != -1:
            resegment(i)
            i = nxt[i]

    def _byte_token(self, byte: int) -> int:
        token = self.ids.get(f"<0x{byte:02X}>", self.ids.get(chr(byte)) if byte < 128 else None)
        if token is not None:
            return token
        if self.unknown >= 0:
            return self.unknown
        raise ValueError(f"byte 0x{byte:02X} has no token in this vocabulary and it names no unknown token")

    # -- decoding ---------------------------------------------------------------------------------

    def decode(self, ids: list[int], skip_special: bool = False, continuation: bool = False) -> str:
        ids = list(ids)
        strip = self.add_space_prefix and not continuation
        if skip_special and self.add_bos and ids and ids[0] == self.bos:
            strip, ids = False, ids[1:]
        out = bytearray()
        for token in ids:
            piece = self._piece(token, skip_special)
            if strip and piece.startswith(b" "):
                piece = piece[1:]
            strip = False
            out += piece
        return out.decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        """The bytes token `token` stands for in a text it continues (a byte token's one byte,
        which alone may be part of a UTF-8 character)."""
        return self._piece(token, skip_special=False)

    def _piece(self, token: int, skip_special: bool) -> bytes:
        if not 0 <= token < len(self.tokens):
            raise ValueError(f"token id {token} is outside the vocabulary (0..{len(self.tokens) - 1})")
        kind, text = self.types[token], self.tokens[token]
        if kind in (TokenType.CONTROL, TokenType.UNKNOWN):
            return b"" if skip_special else text.encode("utf-8")
        if kind == TokenType.USER_DEFINED:
            return text.encode("utf-8")
        if kind == TokenType.NORMAL:
            return text.replace(SPACE, " ").encode("utf-8")
        if kind == TokenType.BYTE:
            found = _BYTE_TOKEN.fullmatch(text)
            return bytes([int(found.group(1), 16)]) if found else text.encode("utf-8")[:1]
        return b""  # unused
