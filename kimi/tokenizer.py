"""Text -> token ids: Kimi's own tiktoken vocabulary when the checkpoint ships it, else a byte-level tokenizer.

* **Kimi tokenizer**: a checkpoint directory holding ``tiktoken.model`` (base64 token + rank per line) is encoded with
  ``tiktoken`` and Kimi's pre-tokenisation pattern (Han runs split off first). Special tokens are read from
  ``tokenizer_config.json`` (``added_tokens_decoder``) when present; ordinary text never produces them.
* **Byte-level tokenizer** (the tiny preset and any checkpoint without ``tiktoken.model``): token id = UTF-8 byte value
  (0..255). Needs ``vocab_size >= 256``. The comparison report says which tokenizer was used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

__all__ = ["Tokenizer", "load_tokenizer", "read_text", "KIMI_PAT_STR", "IGNORE_INDEX"]

IGNORE_INDEX = -100  # a label with no next-token target (torch.nn.functional.cross_entropy's default ignore_index)

# Kimi's pre-tokenisation regex (tokenization_kimi.py): Han runs first, then cased letter runs with English
# contractions, numbers in groups of up to three, punctuation runs, newlines, spaces.
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)


@dataclass(frozen=True)
class Tokenizer:
    """``encode(text) -> list[int]``; ``name`` says which tokenizer it is (for reports); ``token_bytes(id) -> bytes``
    the UTF-8 bytes of one token (b"" for special tokens), for streaming decoded text (``kimi generate``)."""

    name: str
    encode: Callable[[str], list[int]]
    token_bytes: Callable[[int], bytes] = lambda i: b""


def _byte_level(vocab_size: int) -> Tokenizer:
    if vocab_size < 256:
        raise ValueError(f"vocab_size: got {vocab_size}, expected >= 256 for the byte-level tokenizer")
    return Tokenizer(
        "byte-level tokenizer (id = UTF-8 byte)",
        lambda text: list(text.encode("utf-8")),
        lambda i: bytes([i]) if 0 <= i < 256 else b"",  # ids >= 256 are the specials: no text
    )


def load_tokenizer(checkpoint: str | Path | None, vocab_size: int) -> Tokenizer:
    """Kimi's tiktoken tokenizer if ``checkpoint/tiktoken.model`` exists, else the byte-level tokenizer.

    Raises:
        ValueError: a token id of the vocabulary is >= ``vocab_size``, or vocab_size < 256 for the byte-level tokenizer.
    """
    model = Path(checkpoint) / "tiktoken.model" if checkpoint is not None else None
    if model is None or not model.is_file():
        return _byte_level(vocab_size)
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    try:
        ranks = load_tiktoken_bpe(str(model))
    except Exception as e:  # noqa: BLE001 - tiktoken raises plain errors for malformed files
        raise ValueError(
            f"tiktoken.model: {model} is not a tiktoken BPE file (base64 token + rank per line): {e}"
        ) from None
    special: dict[str, int] = {}
    cfg = model.parent / "tokenizer_config.json"
    if cfg.is_file():
        added = json.loads(cfg.read_text(encoding="utf-8")).get("added_tokens_decoder", {})
        special = {v["content"]: int(k) for k, v in added.items() if int(k) >= len(ranks)}
    top = max([*ranks.values(), *special.values()])
    if top >= vocab_size:
        raise ValueError(f"tiktoken.model: token id {top} >= vocab_size {vocab_size} of the checkpoint's config")
    enc = tiktoken.Encoding(name="kimi", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens=special)
    special_ids = set(special.values())

    def token_bytes(i: int) -> bytes:  # special tokens and ids outside the vocabulary carry no text
        if i in special_ids:
            return b""
        try:
            return enc.decode_single_token_bytes(i)
        except KeyError:
            return b""

    return Tokenizer(f"kimi tiktoken ({model})", lambda text: enc.encode(text, disallowed_special=()), token_bytes)


def read_text(path: str | Path) -> str:
    """Read a UTF-8 text file for tokenisation.

    Raises:
        ValueError: the file is empty (or whitespace only) or not valid UTF-8.
        FileNotFoundError: no such file.
    """
    path = Path(path)
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--text: {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    if not text.strip():
        raise ValueError(f"--text: {path} is empty, expected some text")
    return text
