"""Training data for ``kimi train``: read documents, tokenise them, pack them into rows with ``cu_seqlens``.

* **Documents**: a text file is one document; a ``.jsonl`` file holds one document per line (an object with a string
  ``text`` field); a folder contributes its ``.txt``, ``.md``, ``.text`` and ``.jsonl`` files, recursively, in sorted
  order. Empty documents are skipped.
* **Rows** (nanochat's packing, with document boundaries kept): the token stream of the documents, in order, is cut
  into rows of ``seq_len`` input tokens. A row's label at position t is the next token of the same document (the
  row's last label peeks at the first token of the next row), or ``IGNORE_INDEX`` (-100) where the document ends:
  no token is trained to predict the start of an unrelated document. ``cu_seqlens`` marks every document start in
  the row, so the KDA state, the short convolutions and the attention masks reset there (as in the forward).
* **Micro-batches**: ``rows`` rows are concatenated into one packed sequence ``[1, rows * seq_len]`` whose
  ``cu_seqlens`` also breaks at every row boundary, so it computes exactly what ``rows`` separate rows would
  (the packed path of the model takes batch size 1).
* **Position** (exact resume): ``(epoch, doc, offset)``: the next row starts at token ``offset`` of the ``doc``-th
  document of epoch ``epoch``'s order. With ``shuffle`` the order of epoch e is a permutation drawn from
  ``numpy.random.default_rng([seed, e])``, so the position alone restores the stream.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from kimi.tokenizer import IGNORE_INDEX

__all__ = [
    "IGNORE_INDEX",
    "TEXT_SUFFIXES",
    "Batch",
    "read_documents",
    "tokenize_documents",
    "split_tail",
    "PackedLoader",
    "eval_batches",
]

TEXT_SUFFIXES = (".txt", ".md", ".text")


@dataclass
class Batch:
    """One packed micro-batch.

    Attributes:
        input_ids: ``[1, T]`` int64 token ids.
        labels: ``[1, T]`` int64 next-token ids, ``IGNORE_INDEX`` where no target exists (a document's last token).
        cu_seqlens: ``[N+1]`` int64 document (and row) boundaries in ``[0, T]``.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    cu_seqlens: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_targets(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    def to(self, device) -> Batch:
        return Batch(self.input_ids.to(device), self.labels.to(device), self.cu_seqlens.to(device))


def _files(path: Path, flag: str) -> list[Path]:
    if path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in (*TEXT_SUFFIXES, ".jsonl"))
        if not found:
            raise ValueError(f"{flag}: the folder {path} holds no {', '.join((*TEXT_SUFFIXES, '.jsonl'))} files")
        return found
    if not path.is_file():
        raise ValueError(f"{flag}: no file or folder at {path}")
    return [path]


def _decode(path: Path, data: bytes, flag: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag}: {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None


def read_documents(paths: Sequence[str | Path], flag: str = "--data") -> list[str]:
    """The documents of ``paths`` (text files, ``.jsonl`` files with a ``text`` field, folders of them), in order.

    Raises:
        ValueError: a missing path, a folder without text files, a file that is not UTF-8, a JSONL line that is not
            an object with a string ``text`` field (naming file and line), or no non-empty document at all.
    """
    if not paths:
        raise ValueError(f"{flag}: expected at least one text file, JSONL file or folder")
    docs: list[str] = []
    for p in paths:
        for f in _files(Path(p), flag):
            text = _decode(f, f.read_bytes(), flag)
            if f.suffix != ".jsonl":
                if text.strip():
                    docs.append(text)
                continue
            for n, line in enumerate(text.splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{flag}: {f}:{n} is not JSON ({e.msg})") from None
                if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                    raise ValueError(f"{flag}: {f}:{n}: expected a JSON object with a string 'text' field")
                if obj["text"].strip():
                    docs.append(obj["text"])
    if not docs:
        raise ValueError(f"{flag}: no text in {', '.join(str(p) for p in paths)} (every document is empty)")
    return docs


def tokenize_documents(docs: Sequence[str], encode) -> list[np.ndarray]:
    """``encode(text) -> list[int]`` over the documents: a list of int64 arrays, empty encodings dropped."""
    out = [np.asarray(encode(d), dtype=np.int64) for d in docs]
    return [t for t in out if t.size]


def split_tail(docs: list[np.ndarray], fraction: float) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Hold out the last ``fraction`` of the tokens (in document order; a document may be cut in two).

    Returns ``(train_docs, heldout_docs)``. Raises ValueError for a fraction outside (0, 1).
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"--eval-fraction: got {fraction}, expected a fraction in (0, 1)")
    total = sum(len(d) for d in docs)
    keep = total - int(round(total * fraction))
    train, held, seen = [], [], 0
    for d in docs:
        if seen + len(d) <= keep:
            train.append(d)
        elif seen >= keep:
            held.append(d)
        else:
            train.append(d[: keep - seen])
            held.append(d[keep - seen :])
        seen += len(d)
    return [d for d in train if d.size], [d for d in held if d.size]


def num_targets(docs: Sequence[np.ndarray]) -> int:
    """Tokens that have a next token in their document (the trainable targets)."""
    return sum(max(len(d) - 1, 0) for d in docs)


class PackedLoader:
    """An endless, resumable stream of packed micro-batches over tokenised documents (module docstring).

    ``next_batch()`` -> :class:`Batch` of ``rows * seq_len`` tokens; ``state_dict()`` / ``load_state_dict()`` hold
    the position ``{"epoch", "doc", "offset"}`` (plain ints), so a loader restored from a state yields the same
    batches as the one it was saved from.

    Raises:
        ValueError: ``seq_len < 2``, ``rows < 1``, or documents without a single target (all of length 1 or none).
    """

    def __init__(self, docs: list[np.ndarray], seq_len: int, rows: int = 1, seed: int = 0, shuffle: bool = True):
        if seq_len < 2:
            raise ValueError(f"--seq-len: got {seq_len}, expected at least 2 (a row needs a token and its target)")
        if rows < 1:
            raise ValueError(f"rows: got {rows}, expected at least 1")
        if num_targets(docs) == 0:
            raise ValueError("data: no document has two tokens or more, so there is nothing to predict")
        self.docs, self.seq_len, self.rows, self.seed, self.shuffle = docs, seq_len, rows, seed, shuffle
        self.epoch, self.doc, self.offset = 0, 0, 0
        self._order_epoch, self._order = -1, np.arange(0)

    def order(self, epoch: int) -> np.ndarray:
        """Document order of ``epoch``: a seeded permutation (``shuffle``) or file order."""
        if self._order_epoch != epoch:
            n = len(self.docs)
            self._order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            self._order_epoch = epoch
        return self._order

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "doc": self.doc, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        epoch, doc, offset = (int(state[k]) for k in ("epoch", "doc", "offset"))
        if not (epoch >= 0 and 0 <= doc < len(self.docs) and 0 <= offset < len(self.docs[self.order(epoch)[doc]])):
            raise ValueError(
                f"data position: got epoch {epoch}, document {doc}, offset {offset}, which is not inside the "
                f"{len(self.docs)} documents of this data (was the run resumed on other data?)"
            )
        self.epoch, self.doc, self.offset = epoch, doc, offset

    def _advance(self, n: int) -> None:
        """Move the position ``n`` tokens forward, across document and epoch ends."""
        while n:
            d = self.docs[self.order(self.epoch)[self.doc]]
            step = min(n, len(d) - self.offset)
            self.offset += step
            n -= step
            if self.offset == len(d):
                self.offset, self.doc = 0, self.doc + 1
                if self.doc == len(self.docs):
                    self.doc, self.epoch = 0, self.epoch + 1

    def _row(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The pieces (inputs, labels) of one row: each piece is a run of one document."""
        ins, labs, need = [], [], self.seq_len
        while need:
            d = self.docs[self.order(self.epoch)[self.doc]]
            a = self.offset
            b = min(len(d), a + need)
            ins.append(d[a:b])
            lab = np.full(b - a, IGNORE_INDEX, dtype=np.int64)
            lab[: max(0, min(b, len(d) - 1) - a)] = d[a + 1 : min(b + 1, len(d))]  # next token, same document
            labs.append(lab)
            self._advance(b - a)
            need -= b - a
        return ins, labs

    def next_batch(self) -> Batch:
        ins, labs = [], []
        for _ in range(self.rows):
            i, lab = self._row()
            ins += i
            labs += lab
        lengths = [len(x) for x in ins]
        cu = np.concatenate([[0], np.cumsum(lengths)])
        return Batch(
            torch.from_numpy(np.concatenate(ins))[None],
            torch.from_numpy(np.concatenate(labs))[None],
            torch.from_numpy(cu.astype(np.int64)),
        )


def eval_batches(docs: list[np.ndarray], seq_len: int, rows: int, max_tokens: int) -> list[Batch]:
    """A fixed evaluation set: the first ``max_tokens`` tokens of ``docs`` (file order, whole rows, at least one
    row) packed as :class:`PackedLoader` packs them, in micro-batches of up to ``rows`` rows."""
    total = sum(len(d) for d in docs)
    n_rows = max(1, min(total, max_tokens) // seq_len)
    loader = PackedLoader(docs, seq_len, rows=1, shuffle=False)
    out: list[Batch] = []
    for start in range(0, n_rows, rows):
        parts = [loader.next_batch() for _ in range(min(rows, n_rows - start))]
        offsets = [0]
        cus = []
        for p in parts:
            cus.append(p.cu_seqlens[1:] + offsets[-1])
            offsets.append(offsets[-1] + p.num_tokens)
        out.append(
            Batch(
                torch.cat([p.input_ids for p in parts], dim=1),
                torch.cat([p.labels for p in parts], dim=1),
                torch.cat([torch.zeros(1, dtype=torch.int64), *cus]),
            )
        )
    return out
