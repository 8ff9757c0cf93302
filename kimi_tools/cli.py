"""The ``kimi`` command line.

    kimi info    [--preset NAME | --config FILE | --checkpoint DIR] [--json]
    kimi init    --preset NAME --out DIR [--seed N] [--layers N] [--set key=value ...]
    kimi forward [--preset NAME | --checkpoint DIR] [--layers N] [--tokens N] [--seed N] [--backend jax|eager|sdpa]
    kimi compare [--preset NAME | --checkpoint DIR] [--layers N] [--text FILE] [--tokens N] [--backends eager,sdpa]
                 [--dtype float32|bfloat16] [--json FILE] [--against FILE.safetensors [--path jax|eager|sdpa]]
                 [--grad [--documents N] [--dtype float64]] [--fp8 tensorwise|rowwise]
    kimi lora merge --checkpoint BASE --adapter DIR --out DIR
    kimi plan    --gpus N [--preset NAME] [--layers N] [--gpu-memory GB] [--nodes M] [--seq-len S] [--lora-rank R]
                 [--fp8 RECIPE] [--json]: the layouts that fit, each with its torchrun ... kimi train command
    kimi logits  [--preset NAME | --checkpoint DIR] [--layers N] [--backend jax|eager|sdpa] (--text FILE | --ids FILE)
                 --out FILE.safetensors [--hidden] [--tokens N]

Every expected failure (bad config, bad checkpoint, bad argument) prints one line ``kimi: error: ...`` on stderr and
exits with status 2; no traceback. SIGINT (Ctrl-C) and SIGTERM print one line ``kimi CMD: interrupted by SIGINT``
and exit with 130 (143 for SIGTERM), after removing the temporary folders the command made (``kimi train`` handles
both itself: it saves a resume state). Under ``torchrun`` only rank 0 prints these lines; the other ranks exit with
the same status silently.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Sequence

from kimi.config import PRESETS, KimiConfig, load_config
from kimi.layout import layer_plan, param_counts
from kimi_tools import ablate, lora, plan, train
from kimi_tools import generate as generate_cmd
from kimi_tools.common import (
    CliError,
    Interrupted,
    Parser,
    Progress,
    add_source,
    apply_overrides,
    check_fits,
    check_out_file,
    check_out_folder,
    is_quiet_rank,
    materialise_checkpoint,
    positive_int,
    refuse_adapter_folder,
    stop_on_signals,
    token_ids,
    write_atomic,
    write_random_init,
)

__all__ = ["main"]


# ---------------------------------------------------------------------------------------------- info


def cmd_info(args: argparse.Namespace) -> int:
    """``kimi info``: the layer plan and parameter counts of a preset, config or checkpoint (``--json``: one
    object). Returns 0; a bad source raises ConfigError / CheckpointError (one ``kimi: error:`` line)."""
    refuse_adapter_folder(args.checkpoint, "kimi info")
    cfg = load_config(args.preset, getattr(args, "config", None), args.checkpoint)
    counts = param_counts(cfg)
    plan = layer_plan(cfg)
    info = {
        "architecture": cfg.architecture,
        "num_layers": cfg.num_hidden_layers,
        "kda_layers": list(cfg.kda_layers),
        "mla_layers": list(cfg.mla_layers),
        "dsa_layers": list(cfg.dsa_layers),
        "dense_mlp_layers": [p.index for p in plan if p.mlp == "dense"],
        "moe_layers": [p.index for p in plan if p.mlp == "moe"],
        "attn_res_block_writes": [p.index for p in plan if p.block_write],
        **counts,
    }
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"{cfg.architecture}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}")
    print(f"  total params   {counts['total_params']:>20,}  ({_human(counts['total_params'])})")
    print(
        f"  active params  {counts['active_params']:>20,}  ({_human(counts['active_params'])}, "
        f"excluding the input embedding; {_human(counts['active_with_embedding'])} with it)"
    )
    print(f"  KDA layers ({len(cfg.kda_layers)}), 0-based: {_ranges(cfg.kda_layers)}")
    print(f"  MLA layers ({len(cfg.mla_layers)}), 0-based: {_ranges(cfg.mla_layers)}")
    print(
        f"  DSA layers ({len(cfg.dsa_layers)}), 0-based: {_ranges(cfg.dsa_layers)}"
        + (f"  [indexer {cfg.index_n_heads}x{cfg.index_head_dim}, top-k {cfg.index_topk}]" if cfg.dsa_layers else "")
    )
    print(
        f"  dense MLP layers: {_ranges(info['dense_mlp_layers'])}; MoE layers: {_ranges(info['moe_layers'])}"
        + (
            f"  [{cfg.num_experts_per_token} of {cfg.num_experts} experts"
            + (f", latent {cfg.routed_expert_hidden_size}" if cfg.has_latent_moe else "")
            + "]"
            if info["moe_layers"]
            else ""
        )
    )
    if cfg.has_attn_res:
        print(
            f"  AttnRes block size {cfg.attn_res_block_size}: blocks written before layers "
            f"{info['attn_res_block_writes']}"
        )
    print(
        "  layer plan: "
        + "".join({"kda": "K", "mla": "M", "dsa": "D"}[p.attention] for p in plan)
        + "  (K = KDA, M = MLA, D = MLA + DSA indexer)"
    )
    return 0


def _human(n: int) -> str:
    """2779663002208 -> '2.7797 T', 104368138848 -> '104.37 B', 1115496 -> '1.12 M'."""
    for scale, unit, digits in ((1e12, "T", 4), (1e9, "B", 2), (1e6, "M", 2), (1e3, "K", 1)):
        if n >= scale:
            return f"{n / scale:.{digits}f} {unit}"
    return str(n)


def _ranges(xs: Sequence[int]) -> str:
    xs = list(xs)
    if not xs:
        return "none"
    out, start, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ", ".join(out)


# ---------------------------------------------------------------------------------------------- init


def cmd_init(args: argparse.Namespace) -> int:
    """``kimi init``: write a random-initialised checkpoint of ``--preset`` (``--layers N`` keeps the first N,
    ``--set`` overrides config fields) to ``--out``, atomically. Returns 0.

    A checkpoint of a gigabyte or more draws a progress bar on stderr.

    Raises:
        CliError: ``--layers`` beyond the preset, an ``--out`` that is a file (or under one), a non-empty ``--out``
            without ``--force``, a checkpoint larger than the free space there, or a bad ``--set``.
    """
    cfg = apply_overrides(load_config(args.preset), args.set or [])
    if args.layers is not None and args.layers > cfg.num_hidden_layers:
        raise CliError(f"--layers: got {args.layers}, expected at most num_hidden_layers={cfg.num_hidden_layers}")
    out = check_out_folder("--out", args.out, force="--force")
    if out.exists() and any(out.iterdir()) and not args.force:
        raise CliError(f"--out: {out} exists and is not empty; pass --force to overwrite its checkpoint files")
    check_fits(cfg, args.layers, out, f"--preset {args.preset}", f"--out {out}", "write")
    write_random_init(out, cfg, seed=args.seed, layers=args.layers, force=args.force)
    n = args.layers or cfg.num_hidden_layers
    print(f"wrote {out} ({n} layers of {cfg.num_hidden_layers}, seed {args.seed})")
    return 0


# ---------------------------------------------------------------------------------------------- forward


def cmd_forward(args: argparse.Namespace) -> int:
    """A reference (or torch) forward pass on random token ids; prints the logits' shape and statistics."""
    import contextlib

    import numpy as np

    with contextlib.ExitStack() as stack:
        ckpt, source = materialise_checkpoint(args, stack)
        cfg = KimiConfig.from_json(Path(ckpt) / "config.json")
        n = cfg.num_hidden_layers if args.layers is None else min(args.layers, cfg.num_hidden_layers)
        print(f"kimi forward: {source}; {n} layers; {args.tokens} random token ids; backend {args.backend}", flush=True)
        rng = np.random.default_rng(args.seed)
        ids = rng.integers(0, cfg.vocab_size, size=(1, args.tokens))
        if args.backend == "jax":
            from reference_jax.model import load_model

            model, tree, cfg = load_model(ckpt, layers=args.layers)
            logits = np.asarray(model.apply({"params": tree}, ids))
        else:
            import torch

            from kernels_torch.model import load_model as load_torch

            gpu = args.backend == "cudnn"  # the cudnn backend runs on CUDA in bf16 (it says so when it cannot)
            model = load_torch(
                ckpt,
                layers=args.layers,
                backend=args.backend,
                dtype=torch.bfloat16 if gpu else torch.float32,
                device="cuda" if gpu else "cpu",
            )
            with torch.no_grad():
                logits = model(torch.as_tensor(ids, device="cuda" if gpu else "cpu")).float().cpu().numpy()
    finite = bool(np.isfinite(logits).all())
    print(
        f"logits: shape {list(logits.shape)} dtype {logits.dtype} finite {finite} "
        f"mean {logits.mean():+.4f} std {logits.std():.4f} min {logits.min():+.4f} max {logits.max():+.4f}"
    )
    return 0 if finite else 1


# ---------------------------------------------------------------------------------------------- compare


def cmd_compare(args: argparse.Namespace) -> int:
    """``kimi compare``: the oracle (JAX, or the torch eager twin in fp32) against each ``--backends`` entry, layer
    by layer on real text, or (``--against FILE``) one path against logits written elsewhere. Prints the tables
    (and ``--json``). Returns 0 when every report passes its tolerances, 1 otherwise.

    Raises:
        CliError: an unknown backend, CUDA asked for where there is none, bad ``--text`` / ``--ids`` / ``--against``.
    """
    import contextlib

    from kimi_tools.compare import (
        TOLERANCES,
        TOLERANCES_FP8,
        compare_runs,
        first_nonfinite,
        format_fp8_side_by_side,
        format_table,
        run_reference,
        run_torch,
    )

    if args.json:
        check_out_file("--json", args.json)  # --json /dev/full or a/file/x: refused before the run
    if args.fp8 is not None:
        _check_fp8_args(args)  # before anything is loaded: a CPU or a pre-Ada GPU is refused here
    args.dtype = args.dtype or "float32"
    if args.dtype == "float64" and not args.grad:
        raise CliError("--dtype: float64 is for --grad only (the forward comparison runs float32 or bfloat16)")
    if args.backends is None:
        args.backends = "cudnn" if args.fp8 else "eager,sdpa"
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    known = ("eager", "sdpa", "cudnn")
    for b in backends:
        if b not in known:
            raise CliError(f"--backends: got {b!r}, expected a comma-separated subset of {list(known)}")
    if not backends and not args.against:
        raise CliError("--backends: got an empty list, expected at least one of eager, sdpa, cudnn")
    if "cudnn" in backends + [args.path] or args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise CliError(
                "--backends/--device: the cudnn backend and --device cuda need a CUDA GPU, but CUDA is not "
                "available here (use eager or sdpa on a CPU)"
            )
    with contextlib.ExitStack() as stack:
        ckpt, source = materialise_checkpoint(args, stack)
        cfg = KimiConfig.from_json(ckpt / "config.json")
        cfg = cfg if args.layers is None else cfg.truncated(min(args.layers, cfg.num_hidden_layers))
        if args.against:
            return _compare_against(args, ckpt, cfg)
        ids, tok_name = token_ids(args, ckpt, cfg)
        if args.grad:  # per-parameter LM-loss gradients (kimi_tools.gradcheck)
            from kimi_tools.gradcheck import run_grad_compare

            print(f"kimi compare --grad: {source}; {len(ids)} tokens ({tok_name}); backends {','.join(backends)}")
            return run_grad_compare(
                ckpt, ids, backends, args.dtype, args.documents, args.layers, args.device, args.json
            )
        n = cfg.num_hidden_layers
        kinds = [cfg.layer_type(i) for i in range(n)]
        # index_topk only means something when a DSA layer runs (a config without one does not even store it).
        topk = f"index_topk {cfg.index_topk}" if "dsa" in kinds else "no DSA layer"
        fp8_note = f"; fp8 {args.fp8} beside each (kernels_torch.fp8)" if args.fp8 else ""
        print(
            f"kimi compare: {source}; {n} layers ({''.join(k[0].upper() for k in kinds)}); {len(ids)} tokens "
            f"({tok_name}); {topk}; backends {','.join(backends)}; dtype {args.dtype}{fp8_note}",
            flush=True,
        )
        if args.reference == "jax":
            ref = run_reference(ckpt, ids, layers=args.layers, on_layer=Progress("jax", n, args.quiet))
        else:  # the torch eager twin in fp32 (validated against JAX on CPU): a fast oracle for real-size GPU runs
            ref = run_torch(
                ckpt,
                ids,
                layers=args.layers,
                backend="eager",
                dtype="float32",
                device=args.device,
                on_layer=Progress("eager-fp32", n, args.quiet),
            )
            ref.name = "torch-eager fp32"
        reports, runs, pairs = [], [ref], []
        for b in backends:
            other = _run_path(b, ckpt, ids, args, n, ref=ref)
            reports.append(compare_runs(ref, other, kinds, dtype=args.dtype, tol=TOLERANCES[args.dtype]))
            runs.append(other)
            if args.fp8:  # the same backend with its projections and experts in FP8, against the same oracle
                fp8_run = _run_path(b, ckpt, ids, args, n, ref=ref, convert=_fp8_converter(args.fp8))
                reports.append(compare_runs(ref, fp8_run, kinds, dtype=args.dtype, tol=TOLERANCES_FP8))
                runs.append(fp8_run)
                pairs.append((reports[-2], reports[-1]))
    print(format_table(reports))
    for bf16_rep, fp8_rep in pairs:
        print(format_fp8_side_by_side(bf16_rep, fp8_rep))
    nonfinite = {run.name: first_nonfinite(run, kinds) for run in runs}
    for name, where in nonfinite.items():
        if where is not None:
            print(f"kimi compare: {name}: non-finite values, first at {where}", file=sys.stderr)
    if args.json:
        out = {
            "source": source,
            "reference": ref.name,
            "tokens": int(len(ids)),
            "tokenizer": tok_name,
            "num_layers": n,
            "index_topk": cfg.index_topk if "dsa" in kinds else None,
            "dtype": args.dtype,
            "fp8": args.fp8,
            "reports": [r.to_dict() for r in reports],
            "first_nonfinite": nonfinite,
        }
        write_atomic(Path(args.json), json.dumps(out, indent=1).encode())
        print(f"report written to {args.json}")
    failed = [r for r in reports if not r.passed]
    for r in failed:
        first = r.first_divergent_layer
        where = f"first divergent layer {first} ({kinds[first]})" if first is not None else "logits only"
        print(f"kimi compare: FAIL {r.backend}: {where}", file=sys.stderr)
    return 1 if failed else 0


def _run_path(path: str, ckpt: Path, ids, args: argparse.Namespace, n: int, ref=None, convert=None):
    """One path on ``ids`` with a progress bar: the JAX reference (``path == "jax"``) or a torch backend in
    ``args.dtype`` on ``args.device`` (``ref``: the reference run whose per-layer inputs the torch layers take;
    ``convert``: applied to the loaded model first, as ``run_torch``). Returns a ``kimi_tools.compare.RunResult``."""
    from kimi_tools.compare import run_reference, run_torch

    if path == "jax":
        return run_reference(ckpt, ids, layers=args.layers, on_layer=Progress("jax", n, args.quiet))
    label = f"torch-{path}" + ("" if convert is None else " fp8")
    return run_torch(
        ckpt,
        ids,
        layers=args.layers,
        backend=path,
        dtype=args.dtype,
        on_layer=Progress(label, n, args.quiet),
        device=args.device,
        ref=ref,
        convert=convert,
    )


def _check_fp8_args(args: argparse.Namespace) -> None:
    """``kimi compare --fp8 RECIPE``: a known recipe, the forward comparison only, bf16 activations (the default
    under ``--fp8``), and a device that runs FP8 (:func:`_fp8_device_check`).

    Raises:
        ValueError: an unknown recipe; FP8UnsupportedError (a ValueError) for a device that cannot run FP8.
        CliError: ``--fp8`` with ``--grad`` or ``--against``, or with ``--dtype`` other than bfloat16.
    """
    from kernels_torch.fp8 import check_recipe

    check_recipe(args.fp8)
    if args.grad or args.against:
        raise CliError("--fp8: compares the forward against the oracle; it does not combine with --grad or --against")
    if args.dtype not in (None, "bfloat16"):
        raise CliError(f"--fp8: runs bf16 activations around the FP8 GEMMs, got --dtype {args.dtype} (use bfloat16)")
    args.dtype = "bfloat16"
    _fp8_device_check(args.device or "cuda")


def _fp8_device_check(device: str) -> None:
    """Refuse FP8 on ``device`` (``kernels_torch.fp8.check_fp8_supported``: CUDA of compute capability >= 8.9, with
    torchao installed). Grouped experts need 9.0 or 10.0: that is checked when a model that has them is converted."""
    from kernels_torch.fp8 import check_fp8_supported, import_torchao

    check_fp8_supported(device)
    import_torchao()


def _fp8_converter(recipe: str):
    """The ``convert`` callable of an FP8 run: ``kernels_torch.fp8.convert_model_to_fp8`` with ``recipe`` and the
    default exclusions."""
    import functools

    from kernels_torch.fp8 import convert_model_to_fp8

    return functools.partial(convert_model_to_fp8, recipe=recipe)


def _compare_against(args: argparse.Namespace, ckpt: Path, cfg: KimiConfig) -> int:
    """Compare one path's logits (and hidden.{i}, when the file has them) with a file written elsewhere."""
    import numpy as np
    from safetensors.numpy import load_file

    from kimi_tools.compare import TOLERANCES, rel_err

    try:
        theirs = load_file(args.against)
    except Exception as e:  # noqa: BLE001 - report any unreadable file in one line
        raise CliError(f"--against: cannot read {args.against} as safetensors ({e})") from None
    for key in ("input_ids", "logits"):
        if key not in theirs:
            raise CliError(f"--against: {args.against} has no '{key}' tensor (expected input_ids and logits)")
        if theirs[key].size == 0:
            raise CliError(f"--against: {args.against}: '{key}' is empty")
    if theirs["input_ids"].dtype.kind not in "iu":
        raise CliError(f"--against: input_ids has dtype {theirs['input_ids'].dtype}, expected an integer dtype")
    ids = theirs["input_ids"].astype(np.int64).reshape(-1)
    bad = ids[(ids < 0) | (ids >= cfg.vocab_size)]
    if bad.size:
        raise CliError(f"--against: input_ids holds {int(bad[0])}, expected ids in [0, {cfg.vocab_size})")
    from safetensors import safe_open

    with safe_open(args.against, framework="np") as f:
        file_layers = (f.metadata() or {}).get("layers")
    if file_layers is not None and int(file_layers) != cfg.num_hidden_layers:
        raise CliError(
            f"--against: {args.against} was written with {file_layers} layers, this run has "
            f"{cfg.num_hidden_layers} (pass --layers {file_layers})"
        )
    backend = args.path
    n = cfg.num_hidden_layers
    mine = _run_path(backend, ckpt, ids, args, n)
    other = (
        theirs["logits"].astype(np.float32).reshape(mine.logits.shape)
        if theirs["logits"].size == mine.logits.size
        else None
    )
    if other is None:
        raise CliError(
            f"--against: logits shape {list(theirs['logits'].shape)} does not match "
            f"{list(mine.logits.shape)} from this checkpoint"
        )
    tol = TOLERANCES[args.dtype]
    a, b = other.astype(np.float64), mine.logits.astype(np.float64)
    cos = float((a * b).sum() / (np.linalg.norm(a) * np.linalg.norm(b)))
    top1 = float((a.argmax(-1) == b.argmax(-1)).mean())
    lrel = rel_err(a, b)
    print(f"kimi compare --against {args.against}: {len(ids)} tokens, {mine.name} path")
    for i, layer in enumerate(mine.layers):
        h = theirs.get(f"hidden.{i}")
        if h is not None:
            if h.shape != layer["residual"].shape:
                raise CliError(
                    f"--against: hidden.{i} has shape {list(h.shape)}, expected {list(layer['residual'].shape)}"
                )
            print(
                f"  layer {i:>3}: residual rel {rel_err(h, layer['residual']):.2e}  (informational: the verdict "
                f"is on the logits)"
            )
    ok = lrel <= tol.logits_rel and cos >= tol.logits_cos_min and top1 >= tol.top1_min
    print(
        f"logits: rel {lrel:.2e}  cosine {cos:.7f}  top-1 agreement {top1:.4f}  -> {'PASS' if ok else 'FAIL'}  "
        f"(tolerances {args.dtype}: rel <= {tol.logits_rel:.0e}, cosine >= {tol.logits_cos_min}, "
        f"top-1 >= {tol.top1_min})"
    )
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------------- logits


def cmd_logits(args: argparse.Namespace) -> int:
    """``kimi logits``: run one path on ``--text`` / ``--ids`` and write ``input_ids``, fp32 ``logits`` ``[T, vocab]``
    (and ``hidden.{i}`` ``[T, D]`` with ``--hidden``) to ``--out`` as safetensors, atomically. Returns 0.

    Raises:
        CliError: bad ``--text`` / ``--ids``, or CUDA asked for where there is none.
    """
    import contextlib

    import numpy as np
    from safetensors.numpy import save

    from kimi_tools.compare import first_nonfinite

    check_out_file("--out", args.out)  # --out /dev/full or a/file/x: refused before the run
    if not args.text and not args.ids:
        raise CliError("input: expected one of --text FILE or --ids FILE")
    with contextlib.ExitStack() as stack:
        ckpt, source = materialise_checkpoint(args, stack)
        cfg = KimiConfig.from_json(ckpt / "config.json")
        cfg = cfg if args.layers is None else cfg.truncated(min(args.layers, cfg.num_hidden_layers))
        ids, tok_name = token_ids(args, ckpt, cfg)
        n = cfg.num_hidden_layers
        res = _run_path(args.backend, ckpt, ids, args, n)
    tensors = {"input_ids": ids.astype(np.int64), "logits": res.logits.astype(np.float32)}
    if args.hidden:
        for i, layer in enumerate(res.layers):
            tensors[f"hidden.{i}"] = layer["residual"].astype(np.float32)
    meta = {"source": source, "backend": args.backend, "tokenizer": tok_name, "layers": str(n)}
    write_atomic(Path(args.out), save(tensors, metadata=meta))
    print(
        f"wrote {args.out}: input_ids [{len(ids)}], logits {list(res.logits.shape)}"
        + (f", hidden.0..{n - 1}" if args.hidden else "")
        + f" ({res.name}, {tok_name})"
    )
    where = first_nonfinite(res, [cfg.layer_type(i) for i in range(n)])
    if where is not None:  # written anyway, for inspection; the exit status says it is not usable as is
        print(f"kimi logits: warning: non-finite values, first at {where}", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    """The ``kimi`` argument parser: one subcommand per tool, each with ``func`` set to its ``cmd_*`` function."""
    ap = Parser(prog="kimi", description="Kimi K3.1 Pro research tools (JAX reference + torch path).")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("info", help="layer plan and parameter counts")
    add_source(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("init", help="write a random-initialised checkpoint in the real layout")
    p.add_argument("--preset", choices=sorted(PRESETS), required=True)
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=positive_int, help="keep the first N layers")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field (repeatable)")
    p.add_argument("--force", action="store_true", help="write into a non-empty directory")
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("forward", help="one forward pass on random ids; prints logits statistics")
    add_source(p, config_file=False)
    p.add_argument("--layers", type=positive_int)
    p.add_argument("--tokens", type=positive_int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=["jax", "eager", "sdpa", "cudnn"], default="jax")
    p.set_defaults(func=cmd_forward)

    p = sub.add_parser("compare", help="JAX reference vs torch backends, layer by layer, on real text")
    add_source(p, config_file=False)
    p.add_argument("--layers", type=positive_int, help="run the first N layers, then output mix, norm, lm_head")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--text", metavar="FILE", help="UTF-8 text (default: the bundled Alice chapter)")
    src.add_argument("--ids", metavar="FILE", help="a JSON list of token ids instead of text")
    p.add_argument("--tokens", type=positive_int, default=256, help="use the first N tokens (default 256)")
    p.add_argument(
        "--backends", help="comma-separated torch backends (default eager,sdpa; cudnn with --fp8)", default=None
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float64"],
        help="torch dtype (default float32; bfloat16 with --fp8)",
    )
    p.add_argument("--json", metavar="FILE", help="write the full report as JSON")
    p.add_argument("--grad", action="store_true", help="compare LM-loss gradients per parameter instead (jax.grad)")
    p.add_argument("--documents", type=positive_int, default=2, help="with --grad: packed documents (default 2)")
    p.add_argument("--against", metavar="FILE", help="compare with logits written elsewhere (kimi logits format)")
    p.add_argument(
        "--path",
        choices=["jax", "eager", "sdpa", "cudnn"],
        default="jax",
        help="with --against: which path of this project to run (default jax)",
    )
    p.add_argument("--seed", type=int, default=0, help="random-init seed when no --checkpoint is given")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--device", choices=["cpu", "cuda"], help="torch device (default: cuda when available)")
    p.add_argument(
        "--fp8",
        metavar="RECIPE",
        help="also run each backend with its projections and experts in FP8 (torchao; tensorwise or rowwise; "
        "CUDA of compute capability >= 8.9), against the same oracle with the FP8 tolerances",
    )
    p.add_argument(
        "--reference",
        choices=["jax", "eager"],
        default="jax",
        help="the oracle: the JAX reference (default) or the torch eager twin in fp32 (for real-size GPU "
        "runs, where the op-by-op JAX reference is slow)",
    )
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("logits", help="run one path and write input_ids, logits (and hidden states) to safetensors")
    add_source(p, config_file=False)
    p.add_argument("--layers", type=positive_int)
    p.add_argument("--backend", choices=["jax", "eager", "sdpa", "cudnn"], default="jax")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="torch dtype")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--text", metavar="FILE")
    src.add_argument("--ids", metavar="FILE", help="a JSON list of token ids")
    p.add_argument("--tokens", type=positive_int)
    p.add_argument("--out", required=True, metavar="FILE.safetensors")
    p.add_argument("--hidden", action="store_true", help="also write the residual stream after every layer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--device", choices=["cpu", "cuda"], help="torch device (default: cuda when available)")
    p.set_defaults(func=cmd_logits)
    lora.add_parser(sub)
    train.add_parser(sub)
    ablate.add_parser(sub)
    generate_cmd.add_parser(sub)  # kimi generate (kimi_tools/generate.py)
    plan.add_parser(sub)  # kimi plan (kimi_tools/plan/)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kimi`` command line on ``argv`` (default ``sys.argv[1:]``); returns the exit status. Every expected
    failure (CliError, ValueError, OSError) prints one ``kimi: error: ...`` line on stderr and returns 2; SIGINT and
    SIGTERM print one line and return 130 / 143 (module docstring). Under torchrun, ranks other than 0 print
    nothing (:func:`kimi_tools.common.is_quiet_rank`)."""
    args = build_parser().parse_args(argv)
    code = _run(args)
    _end_after_process_group(code)
    return code


def _run(args: argparse.Namespace) -> int:
    """:func:`main` once its arguments are parsed."""
    # kimi train installs its own handlers (finish the step, save, exit); every other command unwinds on a signal.
    signals = contextlib.nullcontext() if args.cmd == "train" else stop_on_signals()
    try:
        with signals:
            return args.func(args)
    except (CliError, ValueError, OSError) as e:  # ConfigError and CheckpointError are ValueErrors
        lines = [ln.strip() for ln in _with_flag(e, args).splitlines() if ln.strip()]
        _say("kimi: error: " + "; ".join(lines))
        return 2
    except Interrupted as e:
        _say(f"kimi {args.cmd}: interrupted by {e.signal_name}")
        return e.exit_code
    except KeyboardInterrupt:  # a Ctrl-C that kimi train did not turn into its own line
        _say(f"kimi {args.cmd}: interrupted by SIGINT")
        return 130


def _end_after_process_group(code: int) -> None:
    """After ``kimi train`` under torchrun closed its process group (every rank past a final barrier, every file
    written: ``kimi_tools.train.parallel.TrainParallel.close``), end the process with ``code`` without the
    interpreter's teardown: the gloo groups that torch's functional collectives used (context and expert
    parallelism's all-gathers and all-to-alls) stay referenced past ``destroy_process_group``, and destroying them
    at interpreter exit aborted a rank about once in twenty runs (``terminate called without an active exception``,
    SIGABRT, a failed launch after a complete run). torch.multiprocessing's spawned children end this way too."""
    train_parallel = sys.modules.get("kimi_tools.train.parallel")
    if train_parallel is None or not train_parallel.TrainParallel.closed_group:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _say(line: str) -> None:
    """``line`` on stderr, from rank 0 only under torchrun."""
    if not is_quiet_rank():
        print(line, file=sys.stderr, flush=True)


def _with_flag(e: BaseException, args: argparse.Namespace) -> str:
    """The message of ``e``; for a bare ``OSError`` (``[Errno 20] Not a directory: 'x'``) it names the option whose
    path the failing file is or lies under: ``--out: runs/x: Not a directory (runs/x/y)``."""
    text = str(e)
    if not (isinstance(e, OSError) and e.filename and text.startswith("[Errno")):
        return text
    failed = Path(os.fspath(e.filename)).absolute()
    for dest, value in vars(args).items():
        if not isinstance(value, str) or dest in ("cmd", "func") or not value:
            continue
        given = Path(value).absolute()
        if failed == given or given in failed.parents:
            where = "" if failed == given else f" ({e.filename})"
            return f"--{dest.replace('_', '-')}: {value}: {e.strerror}{where}"
    return text


if __name__ == "__main__":
    sys.exit(main())
