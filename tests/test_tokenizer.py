"""Text -> ids: Kimi's tiktoken vocabulary when the checkpoint ships tiktoken.model, else the byte-level fallback."""

import base64
import json

import pytest

from kimi.tokenizer import load_tokenizer, read_text


def write_vocab(d, merges=(b"th", b"the", b" the", "中文".encode())):
    """A tiny tiktoken BPE file: all 256 bytes, then a few merges (ranks in order), plus one special token."""
    tokens = [bytes([i]) for i in range(256)] + list(merges)
    (d / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens)))
    (d / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"300": {"content": "[BOS]"}}}))
    return tokens


def test_tiktoken_model_in_checkpoint_dir(tmp_path):
    tokens = write_vocab(tmp_path)
    tok = load_tokenizer(tmp_path, vocab_size=512)
    assert "kimi tiktoken" in tok.name
    ids = tok.encode("the cat 中文English [BOS]")
    assert ids[0] == tokens.index(b"the")  # merges applied
    assert tokens.index("中文".encode()) in ids  # Han run split off and merged
    assert b"".join(tokens[i] for i in ids).decode() == "the cat 中文English [BOS]"  # specials are plain text here
    with pytest.raises(ValueError, match="vocab_size"):
        load_tokenizer(tmp_path, vocab_size=260)


def test_byte_level_fallback_and_bad_files(tmp_path):
    tok = load_tokenizer(tmp_path, vocab_size=512)
    assert "byte-level" in tok.name and tok.encode("hé") == [104, 195, 169]
    with pytest.raises(ValueError, match="vocab_size"):
        load_tokenizer(tmp_path, vocab_size=100)
    (tmp_path / "tiktoken.model").write_text("not base64 !!\n")
    with pytest.raises(ValueError, match="tiktoken.model"):
        load_tokenizer(tmp_path, vocab_size=512)
    (tmp_path / "t.txt").write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match="not UTF-8"):
        read_text(tmp_path / "t.txt")
