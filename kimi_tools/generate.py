"""Text generation on either path: ``generate(...)`` (Python) and ``kimi generate`` (command line).

    kimi generate [--checkpoint DIR | --preset NAME] (--prompt TEXT | --prompt-file FILE) --max-new-tokens N
                  [--temperature T] [--top-p P] [--seed S] [--backend jax|eager|sdpa|cudnn] [--layers N]
                  [--chunk-size C] [--device cpu|cuda] [--decode auto|graph|compile|static|loop]

Notable (nanochat's ``engine.py``, gpt-fast, fla's cache):

* One prefill of each prompt into a model-level cache (``reference_jax.cache`` / ``kernels_torch.cache``; prompts of
  different lengths share one call through per-row ``lengths``), optionally in chunks of ``chunk_size`` tokens, then
  one decode step per new token, in one of two ways (``decode=``):
  - ``"loop"``: one cached model call per token (``KimiK3Model.step``; JAX: ``method="step"`` under ``jax.jit``);
    logits come back to the host in fp32 and the sampler is plain numpy (:func:`sample`), so the same logits give
    the same tokens on every backend.
  - ``"graph"`` / ``"compile"`` / ``"static"`` (torch path): the static-shape step of ``kernels_torch.decode``
    (``Decoder``: cache preallocated to prompt + ``max_new_tokens``, positions on the device), captured in one CUDA
    graph per batch size (``graph``), compiled with ``torch.compile(mode="reduce-overhead")`` (``compile``), or run
    eagerly (``static``, any device), with the sampler on the device inside the step
    (``kernels_torch.decode.sample_device``: the same semantics as :func:`sample`, from one uniform draw per row
    and step of a ``torch.Generator`` seeded with ``seed``; the draws differ from numpy's, so sampled tokens differ
    from ``loop``'s, greedy ones do not). The host reads the new tokens once per step while it streams
    (``on_token``), every ``SYNC_EVERY`` steps to look for ``stop_token``, and once at the end otherwise.
  - ``"auto"`` (default): ``graph`` for a torch model on the ``cudnn`` backend on CUDA, else ``loop``. A
    ``kernels_torch.decode.Decoder`` can be passed instead, to keep its captured graphs across calls.
* Sampling: ``temperature == 0`` is greedy (argmax; ties to the lowest id). Otherwise softmax of ``logits /
  temperature``, cut to the smallest set of tokens whose probability reaches ``top_p`` (nucleus sampling, Holtzman et
  al. 2020; the most likely token is always kept), drawn with ``numpy.random.default_rng(seed)``: one seeded
  generator for the whole call, rows drawn in order at every step.
* Generation stops after ``max_new_tokens`` or, per row, at ``stop_token`` (default: the config's
  ``eos_token_id`` when it lies inside the vocabulary).
* The command streams the decoded text of the prompt's continuation to standard output as tokens arrive (UTF-8
  decoded incrementally, so a multi-byte character prints once complete); timings go to standard error:
  prefill tokens/s (prompt tokens over the prefill's wall time) and decode tokens/s (new tokens over the decode loop's
  wall time, the first call's compilation included on the JAX path, the graph capture on ``graph``).
"""

from __future__ import annotations

import argparse
import codecs
import math
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from kimi_tools.common import CliError, add_source, materialise_checkpoint, positive_int, refuse_adapter_folder

__all__ = ["GenerateResult", "generate", "sample", "add_parser", "cmd_generate", "DECODE_MODES", "SYNC_EVERY"]

DECODE_MODES = ("auto", "graph", "compile", "static", "loop")
CUDA_DECODE_MODES = ("graph", "compile")  # the static step captured in CUDA graphs: CUDA only
SYNC_EVERY = 16  # static decode, not streaming, with a stop token: read the new tokens every this many steps


# ---------------------------------------------------------------------------------------------- sampling


def sample(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> np.ndarray:
    """Next token ids ``[B]`` from last-position logits ``[B, vocab]`` (any float dtype; computed in fp64).

    ``temperature == 0``: argmax. Else nucleus sampling over ``softmax(logits / temperature)`` with ``top_p`` in
    ``(0, 1]``, rows drawn in order from ``rng``.

    Raises:
        ValueError: ``temperature`` negative, NaN or infinite (inf would be a silent uniform draw), ``top_p``
            outside ``(0, 1]`` (NaN included), or a ``temperature`` so small that ``logits / temperature``
            overflows fp64 (use 0 for greedy); a row of ``logits`` with NaN, +inf or only -inf (greedy
            included: argmax would pick the first NaN's id).
    """
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature: got {temperature}, expected a finite number >= 0 (0 = greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p: got {top_p}, expected a probability in (0, 1]")
    logits = np.asarray(logits, np.float64)
    if not np.isfinite(logits.max(-1)).all():  # also greedy: argmax of a NaN row is the first NaN's id, silently
        raise ValueError("logits: a row holds NaN, +inf or only -inf, expected finite values to sample from")
    if temperature == 0:
        return logits.argmax(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        z = logits / temperature
    if not np.isfinite(z.max(-1)).all():  # the logits are finite: the temperature overflowed them
        raise ValueError(
            f"temperature: got {temperature}, so small that logits / temperature overflows; expected 0 (greedy) "
            "or a larger temperature"
        )
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.empty(len(p), np.int64)
    for b, row in enumerate(p):
        order = np.argsort(-row, kind="stable")  # most likely first, ties to the lower id
        keep = np.cumsum(row[order]) - row[order] < top_p  # tokens before which the mass is still below top_p
        chosen = order[keep]
        out[b] = chosen[rng.choice(len(chosen), p=row[chosen] / row[chosen].sum())]
    return out


# ---------------------------------------------------------------------------------------------- the two paths


class _TorchRunner:
    """Cached calls on the torch twin: ids in, fp32 numpy logits out."""

    def __init__(self, model):
        import torch

        self.torch, self.model = torch, model
        self.param = next(model.parameters())

    def init_cache(self, batch: int, max_len: int):
        from kernels_torch.cache import init_cache

        return init_cache(self.model.config, batch, max_len, dtype=self.param.dtype, device=self.param.device)

    def __call__(self, ids: np.ndarray, cache, lengths=None):
        torch = self.torch
        with torch.no_grad():
            logits, cache = self.model.step(torch.as_tensor(ids, device=self.param.device), cache, lengths)
        return logits.float().cpu().numpy(), cache


class _JaxRunner:
    """Cached calls on the reference, each shape compiled once with ``jax.jit`` (``lengths`` static)."""

    def __init__(self, model, params):
        import jax

        self.model, self.params = model, params
        self.dtype = jax.tree.leaves(params)[0].dtype

        def call(p, ids, cache, lengths=None):
            n = None if lengths is None else np.array(lengths)
            return model.apply({"params": p}, ids, cache, n, method="step")

        self.call = jax.jit(call, static_argnames="lengths")

    def init_cache(self, batch: int, max_len: int):
        from reference_jax.cache import init_cache

        return init_cache(self.model.config, batch, max_len, dtype=self.dtype)

    def __call__(self, ids: np.ndarray, cache, lengths=None):
        lengths = None if lengths is None else tuple(int(n) for n in lengths)
        logits, cache = self.call(self.params, np.asarray(ids), cache, lengths=lengths)
        return np.asarray(logits, np.float32), cache


@dataclass
class GenerateResult:
    """``tokens``: the new token ids of each row (prompt excluded); ``stats``: ``prefill_tokens``, ``prefill_s``,
    ``decode_tokens``, ``decode_s`` (wall seconds) and the two rates ``prefill_tok_s``, ``decode_tok_s``."""

    tokens: list[list[int]]
    stats: dict = field(default_factory=dict)


def generate(
    model,
    prompts: Sequence[Sequence[int]] | Sequence[int],
    max_new_tokens: int,
    *,
    params=None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    chunk_size: int | None = None,
    stop_token: int | None = -1,
    on_token: Callable[[int, int], None] | None = None,
    decode="auto",
) -> GenerateResult:
    """Continue each prompt by up to ``max_new_tokens`` tokens.

    Args:
        model: a ``kernels_torch.model.KimiK3Model`` (any backend, device and dtype), or a
            ``reference_jax.model.KimiK3Model`` together with ``params`` (its parameter tree).
        prompts: one list of token ids, or a list of them (rows of different lengths are fine).
        temperature, top_p, seed: see :func:`sample` (temperature 0 = greedy, the default).
        chunk_size: prefill in chunks of this many tokens (equal-length prompts only); None = one call.
        stop_token: a row stops after producing it; -1 (default) = the config's ``eos_token_id`` if inside the
            vocabulary, None = never.
        on_token: ``on_token(row, token_id)`` called for each new token as soon as it is sampled (streaming).
        decode: :data:`DECODE_MODES` (see the module docstring; ``"auto"``: ``graph`` on the ``cudnn`` backend on
            CUDA, else ``loop``), or a ``kernels_torch.decode.Decoder`` of this batch size and at least prompt +
            ``max_new_tokens`` tokens (reset and reused, graphs included).

    Returns:
        :class:`GenerateResult` (new tokens per row and timings).

    Raises:
        ValueError: empty prompts, ids outside the vocabulary, ``max_new_tokens`` < 1, bad sampling arguments,
            ``chunk_size`` with prompts of different lengths, an unknown ``decode`` (or one other than ``loop`` on
            the JAX path, or a CUDA mode off CUDA), a ``Decoder`` of another batch size or too small, NaN or
            infinite logits (static decode: found when the tokens are read).
    """
    rows = [list(prompts)] if prompts and np.isscalar(prompts[0]) else [list(p) for p in prompts]
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError("prompts: got an empty prompt, expected at least one token per row")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: got {max_new_tokens}, expected >= 1")
    sample(np.zeros((1, 2)), temperature, top_p, np.random.default_rng(0))  # argument check before any work
    cfg = model.config
    bad = [i for r in rows for i in r if not 0 <= int(i) < cfg.vocab_size]
    if bad:
        raise ValueError(f"prompts: got token id {bad[0]}, expected ids in [0, {cfg.vocab_size})")
    if stop_token == -1:
        stop_token = cfg.eos_token_id if cfg.eos_token_id is not None and cfg.eos_token_id < cfg.vocab_size else None
    lengths = [len(r) for r in rows]
    if chunk_size is not None and len(set(lengths)) > 1:
        raise ValueError(f"chunk_size: prompts of different lengths {lengths} are prefilled in one call; drop it")
    mode = _decode_mode(model, params, decode)
    B, T = len(rows), max(lengths)
    if T + max_new_tokens > cfg.max_position_embeddings:  # the same policy as the cache-free forward: warn, compute
        warnings.warn(
            f"prompt {T} + max_new_tokens {max_new_tokens} tokens exceed config.max_position_embeddings="
            f"{cfg.max_position_embeddings}: generated anyway (the model has no position embedding), but past the "
            "length it was trained for",
            stacklevel=2,
        )
    ids = np.zeros((B, T), np.int64)  # right padding with id 0: never attended to, never cached
    for b, r in enumerate(rows):
        ids[b, : len(r)] = r
    sampling = dict(temperature=temperature, top_p=top_p, seed=seed)
    emit = _Emitter(B, stop_token, on_token)
    if mode == "loop":
        t_prefill, t_decode = _loop_decode(model, params, ids, lengths, max_new_tokens, chunk_size, emit, **sampling)
    else:
        t_prefill, t_decode = _static_decode(model, mode, ids, lengths, max_new_tokens, chunk_size, emit, **sampling)
    n_new = sum(len(o) for o in emit.out)
    stats = {
        "prefill_tokens": sum(lengths),
        "prefill_s": t_prefill,
        "prefill_tok_s": sum(lengths) / max(t_prefill, 1e-9),
        "decode_tokens": n_new,
        "decode_s": t_decode,
        "decode_tok_s": n_new / max(t_decode, 1e-9),
    }
    return GenerateResult(emit.out, stats)


def _decode_mode(model, params, decode):
    """``decode`` resolved: a mode of :data:`DECODE_MODES` other than auto, or the ``Decoder`` given."""
    if not isinstance(decode, str):
        from kernels_torch.decode import Decoder

        if params is not None or not isinstance(decode, Decoder):
            raise ValueError(
                f"decode: got {type(decode).__name__}, expected one of {list(DECODE_MODES)} or a "
                "kernels_torch.decode.Decoder (torch path)"
            )
        return decode
    if decode not in DECODE_MODES:
        raise ValueError(f"decode: got {decode!r}, expected one of {list(DECODE_MODES)}")
    if params is not None:  # the JAX reference: one jitted cached call per token
        if decode not in ("auto", "loop"):
            raise ValueError(f"decode: got {decode!r} with the JAX model, expected 'loop' (or 'auto')")
        return "loop"
    on_cuda = next(model.parameters()).is_cuda
    if decode in CUDA_DECODE_MODES and not on_cuda:
        raise ValueError(
            f"decode: got {decode!r}, which captures CUDA graphs, but the model is on "
            f"{next(model.parameters()).device}; expected 'static' (the same step, uncaptured) or 'loop' off CUDA"
        )
    if decode != "auto":
        return decode
    return "graph" if getattr(model, "backend", None) == "cudnn" and on_cuda else "loop"


class _Emitter:
    """The new tokens of each row as they are read: appended, streamed (``on_token``), stopped at ``stop_token``."""

    def __init__(self, B: int, stop_token, on_token):
        self.out: list[list[int]] = [[] for _ in range(B)]
        self.done = [False] * B
        self.stop_token, self.on_token = stop_token, on_token

    def __call__(self, tokens) -> bool:
        """One step's tokens ``[B]`` (ints); returns whether every row is done."""
        for b, tok in enumerate(tokens):
            if not self.done[b]:
                self.out[b].append(int(tok))
                if self.on_token is not None:
                    self.on_token(b, int(tok))
                self.done[b] = self.stop_token is not None and int(tok) == self.stop_token
        return all(self.done)


def _loop_decode(model, params, ids, lengths, max_new_tokens, chunk_size, emit, *, temperature, top_p, seed):
    """One cached model call per token, numpy sampling. Returns (prefill seconds, decode seconds)."""
    runner = _JaxRunner(model, params) if params is not None else _TorchRunner(model)
    B, T = ids.shape
    cache = runner.init_cache(B, T + max_new_tokens)
    t0 = time.perf_counter()
    if chunk_size is None:
        logits, cache = runner(ids, cache, None if len(set(lengths)) == 1 else lengths)
        last = logits[np.arange(B), np.asarray(lengths) - 1]  # [B, vocab]
    else:
        for a in range(0, T, chunk_size):
            logits, cache = runner(ids[:, a : a + chunk_size], cache)
        last = logits[:, -1]
    t_prefill = time.perf_counter() - t0
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    for step in range(max_new_tokens):
        nxt = sample(last, temperature, top_p, rng)
        if emit(nxt) or step == max_new_tokens - 1:
            break
        logits, cache = runner(nxt[:, None], cache)  # finished rows keep decoding; their tokens are dropped
        last = logits[:, 0]
    return t_prefill, time.perf_counter() - t0


def _static_decode(model, mode, ids, lengths, max_new_tokens, chunk_size, emit, *, temperature, top_p, seed):
    """The static-shape step of ``kernels_torch.decode`` (captured, compiled or eager), the sampler on the device;
    the host reads the tokens once a step when streaming, every :data:`SYNC_EVERY` steps for a stop token, else once.
    Returns (prefill seconds, decode seconds)."""
    import torch

    from kernels_torch.decode import Decoder

    B, T = ids.shape
    need = T + max_new_tokens
    if isinstance(mode, Decoder):
        dec = mode
        if dec.batch != B or dec.max_len < need - 1:
            raise ValueError(
                f"decode: a Decoder of {dec.batch} rows and max_len {dec.max_len}, expected {B} rows and max_len >= "
                f"{need - 1} (prompt {T} + max_new_tokens {max_new_tokens} - 1)"
            )
        dec.set_sampler(temperature, top_p)
    else:
        dec = Decoder(model, B, need, mode=mode, temperature=temperature, top_p=top_p)
    dev = dec.cache.pos.device

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    with torch.no_grad():
        dec.reset()
        x = torch.as_tensor(ids, device=dev)
        t0 = time.perf_counter()
        last = dec.prefill(x, None if len(set(lengths)) == 1 else lengths, chunk_size)
        sync()
        t_prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        u = torch.rand(max_new_tokens, B, device=dev, generator=torch.Generator(dev).manual_seed(seed))
        every = 1 if emit.on_token is not None else (SYNC_EVERY if emit.stop_token is not None else max_new_tokens)
        out = torch.empty(B, max_new_tokens, dtype=torch.int64, device=dev)
        nxt, read = dec.sample(last, u[0]), 0
        for step in range(max_new_tokens):
            out[:, step] = nxt
            final = step == max_new_tokens - 1
            if (step + 1) % every == 0 or final:
                block = dec.read_tokens(out[:, read : step + 1])  # the one host read: [B, steps] ints
                read = step + 1
                if any(emit([row[j] for row in block]) for j in range(len(block[0]))) or final:
                    break
            nxt, _ = dec.step(nxt, u[step + 1])  # finished rows keep decoding; their tokens are dropped
        sync()
    return t_prefill, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------- command line


def _probability(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {s!r}, expected a number in (0, 1]") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"got {v}, expected a number in (0, 1]")
    return v


def _non_negative(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {s!r}, expected a finite number >= 0") from None
    if not (v >= 0 and math.isfinite(v)):  # float() takes 'inf' and 'nan'
        raise argparse.ArgumentTypeError(f"got {v}, expected a finite number >= 0 (0 = greedy)")
    return v


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``kimi generate``."""
    p = subparsers.add_parser("generate", help="continue a prompt, streaming the text (tokens/s on stderr)")
    add_source(p, config_file=False)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="the prompt text")
    src.add_argument("--prompt-file", metavar="FILE", help="a UTF-8 file holding the prompt")
    p.add_argument("--max-new-tokens", type=positive_int, required=True, metavar="N")
    p.add_argument("--temperature", type=_non_negative, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=_probability, default=1.0, help="nucleus sampling mass (default 1.0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed, and the random-init seed of a --preset")
    p.add_argument("--backend", choices=["jax", "eager", "sdpa", "cudnn"], default="eager")
    p.add_argument("--layers", type=positive_int, help="run the first N layers (then norm and lm_head)")
    p.add_argument("--chunk-size", type=positive_int, help="prefill in chunks of C tokens (default: one call)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="torch device (default: cuda for cudnn, else cpu)")
    p.add_argument(
        "--decode",
        choices=DECODE_MODES,
        default="auto",
        help="decode step: graph = the static-shape step in one CUDA graph (the default on cudnn), compile = "
        "torch.compile reduce-overhead, static = that step uncaptured, loop = one cached model call a token with "
        "numpy sampling (the default elsewhere and the only one on jax)",
    )
    p.set_defaults(func=cmd_generate)
    return p


def cmd_generate(args: argparse.Namespace) -> int:
    """``kimi generate``: load, prefill, decode; text to stdout as it comes, statistics to stderr."""
    import contextlib

    from kimi.tokenizer import load_tokenizer

    refuse_adapter_folder(args.checkpoint, "kimi generate")
    device = args.device or ("cuda" if args.backend == "cudnn" else "cpu")
    if args.decode in CUDA_DECODE_MODES and args.backend != "jax" and device != "cuda":
        raise CliError(
            f"--decode: got {args.decode!r}, which captures CUDA graphs, but the model would run on {device} "
            f"(--device); expected --decode static (the same static-shape step, uncaptured) or loop on the CPU, or "
            "--device cuda"
        )
    if args.prompt_file is not None:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise CliError(f"--prompt-file: no file at {path}")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise CliError(f"--prompt-file: {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    else:
        text = args.prompt
    flag = "--prompt" if args.prompt_file is None else "--prompt-file"  # the errors name the flag that was given
    if not text:
        got = "an empty prompt" if args.prompt_file is None else f"an empty file {args.prompt_file}"
        raise CliError(f"{flag}: got {got}, expected some text")
    if args.backend == "jax" and args.decode not in ("auto", "loop"):
        raise CliError(f"--decode: got {args.decode!r} with --backend jax, expected loop (or auto)")
    with contextlib.ExitStack() as stack:
        ckpt, desc = materialise_checkpoint(args, stack)
        if args.backend == "jax":
            from reference_jax.model import load_model

            model, params, cfg = load_model(ckpt, layers=args.layers)
        else:
            import torch

            from kernels_torch.model import load_model as load_torch

            gpu = args.backend == "cudnn"
            device = args.device or ("cuda" if gpu else "cpu")
            model = load_torch(
                ckpt,
                layers=args.layers,
                backend=args.backend,
                dtype=torch.bfloat16 if gpu else torch.float32,
                device=device,
            )
            params, cfg = None, model.config
        tok = load_tokenizer(ckpt, cfg.vocab_size)
        ids = tok.encode(text)
        if not ids:
            raise CliError(f"{flag}: the text encodes to no tokens")
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

        def on_token(row: int, token: int) -> None:
            sys.stdout.write(decoder.decode(tok.token_bytes(token)))
            sys.stdout.flush()

        mode = _decode_mode(model, params, args.decode)
        print(
            f"[{desc}, backend {args.backend}, decode {mode}, {tok.name}, {len(ids)} prompt tokens]",
            file=sys.stderr,
        )
        sys.stdout.write(text)
        sys.stdout.flush()
        res = generate(
            model,
            ids,
            args.max_new_tokens,
            params=params,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            chunk_size=args.chunk_size,
            on_token=on_token,
            decode=mode,
        )
        sys.stdout.write(decoder.decode(b"", final=True) + "\n")
        sys.stdout.flush()
    s = res.stats
    print(
        f"prefill: {s['prefill_tokens']} tokens in {s['prefill_s']:.3f} s ({s['prefill_tok_s']:.1f} tok/s); "
        f"decode: {s['decode_tokens']} tokens in {s['decode_s']:.3f} s ({s['decode_tok_s']:.1f} tok/s)",
        file=sys.stderr,
    )
    return 0
