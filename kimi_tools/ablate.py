"""``kimi ablate``: a grid of config overrides against one checkpoint (torch path, CPU or GPU).

    kimi ablate [--checkpoint DIR | --preset NAME] --set index_topk=16,32,dense --set gate_lower_bound=-5,none \\
        --out DIR [--text FILE] [--tokens N] [--seq-len N] [--train-steps N --data PATH ...]

Every combination of the ``--set`` values is one *cell*: the checkpoint's weights under the overridden config
(``KimiConfig.replace``, validated; an override that changes the tensor layout is refused by the loader, naming the
tensor). Value words: ``dense`` (``index_topk`` only: every visible key selected, spec 9), ``none`` (null); anything
else is parsed as JSON, else kept as a string. Per cell:

* ``eval_loss``: mean next-token cross-entropy on held-out text (``--text``, default the bundled Alice chapter; the
  first ``--tokens`` tokens in rows of ``--seq-len``);
* ``indexer_recall``: share of the dense head-summed attention mass on the selected keys, averaged over queries and
  DSA layers (1 when every visible key is selected; :func:`kimi_tools.distill.model_recall`);
* per-layer error against the unchanged model (``kimi_tools.compare``: each layer of the variant is fed the unchanged
  model's inputs of that layer, so a row is that layer's own change; relative error of the attention output, the MLP
  output and the residual), columns ``attn_rel.{i}``, ``residual_rel.{i}``, and the end-to-end ``logits_rel``.

With ``--train-steps N`` each cell is instead trained N steps from the same checkpoint with ``kimi train``'s API
(:func:`kimi_tools.train.train`, ``--stage``, on ``--data``; the run folders under ``DIR/runs/``), and ``eval_loss`` is
that run's final held-out loss (``eval_lm_loss`` for distillation stages), recall measured on the trained weights.

Every grid also runs the cell without overrides, ``(unchanged)`` (first; in ``--train-steps`` mode the unchanged
config trained the same way): the baseline the other cells are read against.

Output in ``--out``: ``ablate.csv`` and ``ablate.json`` (one row per finished cell, rewritten atomically after each
cell), ``ablate.png`` (:func:`ablate_figure`: eval loss and recall per cell against the unchanged model's, on an
axis zoomed to the data, and the per-layer errors, cells x layers). Progress: a tqdm bar over the cells on stderr.

Re-runs: every row records the *setting* its numbers depend on besides its own overrides (:data:`SETTING_FIELDS`:
the checkpoint's fingerprint :func:`kimi_tools.lora.base_fingerprint`, the text's name and the SHA-256 of the
evaluated token ids, ``tokens``, ``seq_len``, the mode, backend and device, and in ``--train-steps`` mode the
training arguments, columns ``train.<arg>``). A re-run into a folder whose rows have the same setting skips the
cells already there and measures the others; a folder holding rows of another setting (another checkpoint, text,
token count, ...) is refused in one line naming each differing field with both values, unless ``--restart``
(``restart=True``) deletes the earlier results (``ablate.csv``, ``ablate.json``, ``ablate.png``, ``runs/``) first,
as ``kimi train`` does.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import itertools
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

from kimi.checkpoint import write_atomic
from kimi_tools.common import (
    DEFAULT_TEXT,
    CliError,
    check_out_folder,
    materialise_checkpoint,
    positive_int,
    refuse_adapter_folder,
    set_item_error,
)

__all__ = [
    "parse_grid",
    "cell_config",
    "run_grid",
    "ablate_figure",
    "add_parser",
    "cmd_ablate",
    "UNCHANGED",
    "SETTING_FIELDS",
]


def _value(key: str, word: str) -> Any:
    if word == "dense":
        if key != "index_topk":
            raise CliError(f"--set: got {key}=dense; 'dense' applies to index_topk only")
        from kimi_tools.distill import DENSE_TOPK

        return DENSE_TOPK
    if word in ("none", "null"):
        return None
    try:
        return json.loads(word)
    except json.JSONDecodeError:
        return word


def parse_grid(sets: list[str], fields: set[str]) -> list[dict[str, tuple[str, Any]]]:
    """``["index_topk=16,dense", "gate_lower_bound=-5,none"]`` -> one dict per cell, ``{key: (word, value)}``, in
    row-major order (the first ``--set`` varies slowest).

    Raises:
        CliError: an item without ``=``, an unknown key, an empty value list or a key given twice.
    """
    axes = []
    seen = set()
    for item in sets:
        key, sep, values = item.partition("=")
        if not sep or key not in fields:
            raise set_item_error(item, fields, "key=v1,v2,...")
        if key in seen:
            raise CliError(f"--set: {key} given twice; list its values once (e.g. {key}=a,b)")
        seen.add(key)
        words = [w.strip() for w in values.split(",") if w.strip()]
        if not words:
            raise CliError(f"--set: got {item!r}, expected at least one value after '='")
        axes.append([(key, w, _value(key, w)) for w in words])
    return [{k: (w, v) for k, w, v in combo} for combo in itertools.product(*axes)]


UNCHANGED = "(unchanged)"  # the key of the cell without overrides: the baseline every grid also measures


def cell_key(cell: dict[str, tuple[str, Any]]) -> str:
    return ",".join(f"{k}={w}" for k, (w, _) in cell.items()) or UNCHANGED


def cell_config(base, cell: dict[str, tuple[str, Any]]):
    """The base ``KimiConfig`` with the cell's overrides (validated: a bad value raises ConfigError naming it)."""
    return base.replace(**{k: v for k, (_, v) in cell.items()}) if cell else base


def _build(cfg, params, backend: str, device: str):
    import torch

    from kernels_torch.model import model_from_params

    return model_from_params(cfg, params, backend, torch.float32, device).eval()


def _eval(model, rows, device: str) -> tuple[float, float | None]:
    """(mean next-token loss over the rows, mean indexer recall or None without DSA layers)."""
    import torch
    import torch.nn.functional as F

    from kimi_tools.distill import model_recall

    total, n, recalls = 0.0, 0, []
    with torch.no_grad():
        for row in rows:
            ids = row[None].to(device)
            logits = model(ids)
            total += float(F.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="sum"))
            n += ids.shape[1] - 1
            rec = model_recall(model, ids)
            if rec:
                recalls.append(sum(rec.values()) / len(rec))
    return total / max(n, 1), (sum(recalls) / len(recalls) if recalls else None)


def _layer_errors(model, ref, kinds, ids, device) -> dict[str, float]:
    """Per-layer (layer-local) and logits errors of ``model`` against the unchanged model's run ``ref``."""
    import numpy as np
    import torch

    from kimi_tools.compare import RunResult, compare_runs
    from kimi_tools.compare import layer_local as _layer_local

    def to_np(t):
        t = t.detach().cpu()
        return t.float().numpy() if t.is_floating_point() else t.numpy()

    with torch.no_grad():
        logits = model(torch.as_tensor(np.asarray(ids), device=device)[None])
    layers = _layer_local(model, ref, to_np, device)
    for row in layers:  # the selection itself is what the override changes: measure its effect, not its agreement
        row.pop("topk_indices", None)
    rep = compare_runs(ref, RunResult("variant", to_np(logits)[0], layers), kinds)
    out: dict[str, float] = {"logits_rel": rep.logits_rel}
    for r in rep.layers:
        out[f"attn_rel.{r.layer}"] = r.attn_rel
        out[f"residual_rel.{r.layer}"] = r.residual_rel
    return out


def _write(out: Path, rows: list[dict[str, Any]]) -> None:
    cols: list[str] = []
    for r in rows:
        cols += [c for c in r if c not in cols]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols)
    w.writeheader()
    for r in rows:
        w.writerow(r)
    write_atomic(out / "ablate.csv", buf.getvalue().encode())
    write_atomic(out / "ablate.json", json.dumps(rows, indent=1).encode())


# The fields of a row, besides its cell's overrides, that its numbers depend on (``train.*``: the training arguments
# of ``--train-steps`` mode, present in that mode only). Rows of one folder share them all.
SETTING_FIELDS = ("checkpoint", "text", "text_sha256", "tokens", "seq_len", "mode", "backend", "device")
RESULT_FILES = ("ablate.csv", "ablate.json", "ablate.png")


def _setting_of(row: dict[str, Any]) -> dict[str, Any]:
    """The row's setting: :data:`SETTING_FIELDS` (``None`` where a row written before they existed lacks one) and its
    ``train.*`` fields."""
    return {**{k: row.get(k) for k in SETTING_FIELDS}, **{k: v for k, v in row.items() if k.startswith("train.")}}


def _check_setting(out: Path, done: list[dict[str, Any]], setting: dict[str, Any]) -> None:
    """Refuse earlier rows in ``out`` measured under another setting, naming each differing field with both values.

    Raises:
        CliError: a row of ``out/ablate.json`` whose setting differs from ``setting``.
    """
    for row in done:
        was = _setting_of(row)
        keys = list(setting) + [k for k in was if k not in setting]
        diffs = [
            f"{k} ({out.name}: {was.get(k)!r}, now: {setting.get(k)!r})" for k in keys if was.get(k) != setting.get(k)
        ]
        if diffs:
            raise CliError(
                f"--out: {out} holds cells measured under another setting ({'; '.join(diffs)}): their numbers are not "
                "comparable with this run's; choose another --out, or pass --restart to delete its results and start "
                "over"
            )


def _restart(out: Path) -> None:
    """Delete the earlier results of ``kimi ablate`` in ``out`` (:data:`RESULT_FILES` and ``runs/``), nothing else."""
    import shutil

    for name in RESULT_FILES:
        (out / name).unlink(missing_ok=True)
    if (out / "runs").is_dir():
        shutil.rmtree(out / "runs")


def _overrides(row: dict[str, Any]) -> list[tuple[str, str]]:
    """The cell's ``(key, word)`` pairs, read back from its key ``k1=w1,k2=w2`` (words hold no comma)."""
    if row["cell"] == UNCHANGED:
        return []
    return [tuple(item.partition("=")[::2]) for item in row["cell"].split(",")]  # type: ignore[misc]


def _digits(values: list[float]) -> int:
    """Decimals that tell the values apart: 4, more when they differ by less than 1e-3 (at most 8)."""
    span = max(values) - min(values) if values else 0.0
    return 4 if span == 0 or span >= 1e-3 else min(8, 2 + math.ceil(-math.log10(span)))


def _dot_panel(ax, cells, metric: str, base_row, label: str, zoom: bool) -> None:
    """One marker per cell: x = the last override key's words, one series per combination of the other keys;
    value labels; the unchanged model as a dashed line. ``zoom``: the y axis spans the data (not from 0)."""
    keys: list[str] = []
    for r in cells:
        keys += [k for k, _ in _overrides(r) if k not in keys]
    words = lambda r: dict(_overrides(r)) or {"cell": r["cell"]}  # noqa: E731
    keys = keys or ["cell"]  # no override anywhere: one point per row, named by its cell
    last = keys[-1]
    xs: list[str] = []
    series: dict[tuple, list] = {}
    for r in cells:
        w = words(r)
        x = w.get(last, "(base)")
        xs += [x] if x not in xs else []
        series.setdefault(tuple(w.get(k, "(base)") for k in keys[:-1]), []).append((x, r[metric]))
    vals = [v for pts in series.values() for _, v in pts if v is not None]
    base = None if base_row is None else base_row.get(metric)
    nd = _digits(vals + ([base] if base is not None else [])) if metric == "eval_loss" else 3
    n = len(series)
    width = 0.6 / max(n, 1) if n > 1 else 0.0
    markers = "osD^vPX*"
    for j, (combo, pts) in enumerate(series.items()):
        name = ", ".join(f"{k}={w}" for k, w in zip(keys[:-1], combo)) or None
        px = [xs.index(x) + (j - (n - 1) / 2) * width for x, v in pts if v is not None]
        py = [v for _, v in pts if v is not None]
        ax.plot(px, py, marker=markers[j % len(markers)], linestyle="none", color=f"C{j % 10}", label=name)
        for x_, y_ in zip(px, py):
            ax.annotate(f"{y_:.{nd}f}", (x_, y_), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
    if base is not None:
        ax.axhline(base, color="0.35", linestyle="--", linewidth=1, label=f"unchanged model {base:.{nd}f}")
    ax.set_xticks(range(len(xs)), xs)
    ax.set_xlim(-0.5, len(xs) - 0.5)
    ax.set_xlabel(last)
    if zoom and vals:
        both = vals + ([base] if base is not None else [])
        lo, hi = min(both), max(both)
        pad = (hi - lo) * 0.15 if hi > lo else max(abs(hi) * 1e-3, 1e-6)
        ax.set_ylim(lo - pad, hi + 2 * pad)  # room for the labels above the markers
        ax.ticklabel_format(axis="y", useOffset=False, style="plain")
        label += ", zoomed: not from 0"
    else:
        ax.set_ylim(0, 1.1)
    ax.set_ylabel(label)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="best")


def _error_heatmap(fig, ax, cells, prefix: str, title: str, extra: str | None = None) -> None:
    """Cells x layers of ``{prefix}.{i}`` (plus the ``extra`` column), log colour; exact zeros drawn as '0' on grey
    (a log scale has no zero)."""
    import matplotlib as mpl
    import numpy as np
    from matplotlib.colors import LogNorm

    layers = sorted({int(c.split(".")[1]) for r in cells for c in r if c.startswith(prefix + ".")})
    cols = [f"{prefix}.{i}" for i in layers] + ([extra] if extra else [])
    M = np.array([[np.nan if r.get(c) is None else float(r[c]) for c in cols] for r in cells])
    pos = M[np.isfinite(M) & (M > 0)]
    masked = np.ma.masked_where(~(np.isfinite(M) & (M > 0)), M)
    cmap = mpl.colormaps["viridis"].with_extremes(bad="0.88")  # grey: exactly 0 (or not measured)
    norm = LogNorm(vmin=pos.min(), vmax=max(pos.max(), pos.min() * 1.0001)) if pos.size else None
    im = ax.imshow(masked, aspect="auto", cmap=cmap, norm=norm, interpolation="nearest")
    if pos.size:
        fig.colorbar(im, ax=ax, label="relative error (log scale)")
    if M.size <= 240:
        for (i, j), v in np.ndenumerate(M):
            txt = "-" if not np.isfinite(v) else "0" if v == 0 else f"{v:.1e}"
            dark = norm is not None and v > 0 and norm(v) < 0.6
            ax.text(j, i, txt, ha="center", va="center", fontsize=7, color="white" if dark else "black")
    if extra:
        ax.axvline(len(layers) - 0.5, color="white", linewidth=3)  # the end-to-end column apart from the layers
    ax.set_xticks(range(len(cols)), [str(i) for i in layers] + (["logits"] if extra else []))
    ax.set_yticks(range(len(cells)), [r["cell"] for r in cells], fontsize=7)
    ax.set_ylabel("cell")
    ax.set_xlabel("layer" + (" (and the logits, end to end)" if extra else ""))
    ax.set_title(f"{title} (grey: exactly 0)", fontsize=9)


def ablate_figure(rows: list[dict[str, Any]]):
    """The figure ``kimi ablate`` writes (``ablate.png``), a ``matplotlib.figure.Figure`` built without pyplot.

    Args:
        rows: rows of one mode, text and token count (as ``run_grid`` returns them); the ``(unchanged)`` row, when
            present, is the baseline.

    Top: eval loss per cell (markers; x = the last ``--set`` key's values, one series per combination of the
    others, i.e. the grid drawn as a grid), the axis zoomed to the data, value labels, the unchanged model as a
    dashed line; indexer recall the same way on a 0-1 axis (when the model has DSA layers). Bottom (eval mode):
    the per-layer errors of the CSV, cells x layers on a log colour scale, exact zeros as '0' on grey: the
    attention output (``attn_rel.i``) and the layer's residual output (``residual_rel.i``, with ``logits_rel``).
    """
    from matplotlib.figure import Figure

    base_row = next((r for r in rows if r["cell"] == UNCHANGED), None)
    cells = [r for r in rows if r["cell"] != UNCHANGED]
    if not cells:  # only the unchanged model: draw it as its own cell
        cells, base_row = rows, None
    has_recall = any(r.get("indexer_recall") is not None for r in rows)
    has_layers = any(c.startswith("attn_rel.") for r in cells for c in r)
    h_heat = 1.2 + 0.3 * len(cells)
    fig = Figure(figsize=(13, 3.8 + (h_heat if has_layers else 0.0)), layout="constrained")
    top, bottom = fig.subfigures(2, 1, height_ratios=[3.8, h_heat]) if has_layers else (fig, None)
    ax_top = top.subplots(1, 2 if has_recall else 1, squeeze=False)[0]
    _dot_panel(ax_top[0], cells, "eval_loss", base_row, "eval loss, nats/token", zoom=True)
    ax_top[0].set_title("held-out loss per cell", fontsize=10)
    if has_recall:
        _dot_panel(ax_top[1], cells, "indexer_recall", base_row, "indexer recall", zoom=False)
        ax_top[1].set_title("indexer recall (share of the dense attention mass selected)", fontsize=10)
    if bottom is not None:
        ax_b = bottom.subplots(1, 2)
        _error_heatmap(bottom, ax_b[0], cells, "attn_rel", "attention output vs the unchanged model, per layer")
        _error_heatmap(
            bottom, ax_b[1], cells, "residual_rel", "layer output (residual) vs the unchanged model", "logits_rel"
        )
    r0 = rows[0]
    fig.suptitle(
        f"kimi ablate ({r0['mode']}): {r0['tokens']} tokens of {r0['text']}; each layer fed the unchanged "
        "model's inputs"
        if has_layers
        else f"kimi ablate ({r0['mode']}): {r0['tokens']} tokens of {r0['text']}"
    )
    return fig


def _plot(out: Path, rows: list[dict[str, Any]]) -> None:
    from kimi_tools.plots import save_png

    save_png(ablate_figure(rows), out / "ablate.png")


def run_grid(
    checkpoint: str | Path,
    sets: list[str],
    out: str | Path,
    *,
    text: str | Path | None = None,
    tokens: int = 512,
    seq_len: int = 256,
    backend: str = "eager",
    device: str = "cpu",
    train_steps: int | None = None,
    train_kwargs: dict[str, Any] | None = None,
    quiet: bool = False,
    restart: bool = False,
) -> list[dict[str, Any]]:
    """Run (or continue) the grid; returns every row of ``DIR/ablate.json`` (earlier runs included).

    Args:
        checkpoint: the model (config.json + safetensors). sets: ``["key=v1,v2", ...]``. out: the output folder.
        text: held-out text (default the bundled Alice chapter); tokens / seq_len: how much of it, in rows of.
        backend / device: the torch backend and device of the evaluations.
        train_steps: train each cell this many steps first (``kimi_tools.train``), with ``train_kwargs`` passed to
            ``TrainArgs`` (``data`` required; ``stage``, ``lr``, ``seq_len``, ...).
        restart: delete the earlier results in ``out`` first (``--restart``); without it, rows of ``out`` measured
            under another setting (see the module docstring) are refused.

    Raises:
        CliError: bad ``--set`` items, missing text/data, ``out`` holding rows of another setting (another
        checkpoint, text, token count, ...) without ``restart``; ValueError (ConfigError, CheckpointError): a bad
        override value, or one that changes the tensor layout.
    """
    import torch

    from kimi.checkpoint import CheckpointReader, load_params
    from kimi.tokenizer import load_tokenizer, read_text
    from kimi_tools.compare import run_torch

    out = Path(out)
    reader = CheckpointReader(checkpoint)
    base = reader.config
    fields = set(base.__dataclass_fields__) - {"raw"}
    cells = [{}] + parse_grid(sets, fields)  # the unchanged model first: the baseline of the plot
    for cell in cells:  # validate every override before any work
        cell_config(base, cell)
    text = Path(text or DEFAULT_TEXT)
    if not text.is_file():
        raise CliError(f"--text: no file at {text}")
    ids = load_tokenizer(checkpoint, base.vocab_size).encode(read_text(text))[:tokens]
    if len(ids) < 2:
        raise CliError(f"--text: {text} gives {len(ids)} tokens, expected at least 2")
    rows_ids = [
        torch.tensor(ids[i : i + seq_len]) for i in range(0, len(ids), seq_len) if len(ids[i : i + seq_len]) > 1
    ]
    mode = f"train{train_steps}" if train_steps else "eval"
    from kimi_tools.lora import base_fingerprint

    setting: dict[str, Any] = {
        "checkpoint": base_fingerprint(checkpoint),
        "text": text.name,
        "text_sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest(),
        "tokens": len(ids),
        "seq_len": seq_len,
        "mode": mode,
        "backend": backend,
        "device": device,
    }
    if train_steps:  # the training arguments, JSON-typed (paths as strings), as kimi train's fingerprint holds them
        kw = json.loads(json.dumps(train_kwargs or {}, default=str))
        setting.update(
            {f"train.{k}": json.dumps(v) if isinstance(v, list | dict) else v for k, v in sorted(kw.items())}
        )
    out.mkdir(parents=True, exist_ok=True)
    if restart:
        _restart(out)
    done: list[dict[str, Any]] = []
    if (out / "ablate.json").is_file():
        done = json.loads((out / "ablate.json").read_text(encoding="utf-8"))
    _check_setting(out, done, setting)
    finished = {r["cell"] for r in done}
    todo = [c for c in cells if cell_key(c) not in finished]
    if len(todo) < len(cells) and not quiet:
        print(f"kimi ablate: {len(cells) - len(todo)} of {len(cells)} cells already in {out}; skipped", file=sys.stderr)

    params = load_params(reader, base)
    ref = None
    if todo and not train_steps:
        ref = run_torch(checkpoint, ids[:seq_len], backend="eager", device=device)  # the unchanged model, per layer
    kinds = [base.layer_type(i) for i in range(base.num_hidden_layers)]

    from tqdm.auto import tqdm

    for cell in tqdm(todo, desc="ablate", unit="cell", disable=quiet):
        cfg = cell_config(base, cell)
        row: dict[str, Any] = {"cell": cell_key(cell), **{k: w for k, (w, _) in cell.items()}}
        row.update(setting)
        if train_steps:
            res = _train_cell(checkpoint, cfg, cell, out, train_steps, train_kwargs or {})
            model = _build(cfg, load_params(CheckpointReader(res.out), cfg), backend, device)
            last = [r for r in res.records if r.get("eval_loss") is not None][-1]
            row["train_eval_loss"] = last.get("eval_lm_loss", last["eval_loss"])
            row["eval_loss"], row["indexer_recall"] = _eval(model, rows_ids, device)
        else:
            model = _build(cfg, params, backend, device)
            row["eval_loss"], row["indexer_recall"] = _eval(model, rows_ids, device)
            row.update(_layer_errors(model, ref, kinds, ids[:seq_len], device))
        done.append(row)
        _write(out, done)  # one row per finished cell, never a half-written file
    if done:
        _plot(out, done)  # every row has this run's setting (checked above)
    return done


def _train_cell(checkpoint, cfg, cell, out: Path, steps: int, kwargs: dict[str, Any]):
    """Train one cell from ``checkpoint`` under ``cfg``: a folder of links to the weights plus the cell's config."""
    import os

    from kimi_tools.train import TrainArgs, train

    if not kwargs.get("data"):
        raise CliError("--train-steps: needs --data (the training text)")
    run_dir = out / "runs" / (cell_key(cell) if cell else "unchanged").replace("/", "_").replace(",", "__")
    src = Path(checkpoint).resolve()
    with tempfile.TemporaryDirectory(prefix="kimi-ablate-") as tmp:
        for f in src.iterdir():
            if f.name != "config.json" and f.is_file():
                os.symlink(f, Path(tmp) / f.name)
        write_atomic(Path(tmp) / "config.json", json.dumps(cfg.to_dict(), indent=1).encode())
        if run_dir.exists():
            import shutil

            shutil.rmtree(run_dir)  # an unfinished earlier attempt: start the cell over
        args = {"steps": steps, "eval_every": steps, "quiet": True, "warmup_steps": 0, **kwargs}
        return train(TrainArgs(out=str(run_dir), checkpoint=tmp, **args))


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("ablate", help="a grid of config overrides against one checkpoint (eval or train)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--checkpoint", metavar="DIR", help="the checkpoint (config.json + safetensors)")
    g.add_argument("--preset", help="random init of a built-in config (default: tiny)")
    p.add_argument("--seed", type=int, default=0, help="init seed for --preset")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="a grid axis: config field and its values ('dense' = no top-k for index_topk; 'none' = null)",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="where ablate.csv / .json / .png go (re-run: resume)")
    p.add_argument("--text", metavar="FILE", help="held-out text (default: the bundled Alice chapter)")
    p.add_argument("--tokens", type=positive_int, default=512, help="tokens of held-out text")
    p.add_argument("--seq-len", type=positive_int, default=256, help="tokens per evaluated row")
    p.add_argument("--backend", choices=["eager", "sdpa"], default="eager")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--train-steps", type=positive_int, help="train each cell N steps first (kimi train's API)")
    p.add_argument("--data", nargs="+", metavar="PATH", help="training text for --train-steps")
    p.add_argument("--stage", default="lm", help="training stage for --train-steps (lm, indexer-warmup, sparse)")
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate for --train-steps")
    p.add_argument(
        "--restart",
        action="store_true",
        help="delete the results already in --out (ablate.csv/.json/.png, runs/) and start over; needed when they "
        "were measured under another checkpoint, text, --tokens, --seq-len or mode",
    )
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_ablate)
    return p


def cmd_ablate(args: argparse.Namespace) -> int:
    """``kimi ablate``: the grid of ``--set`` axes over ``--checkpoint`` (or a random init of ``--preset`` in a
    temporary folder, :func:`kimi_tools.common.materialise_checkpoint`), results in ``--out``. Returns 0.

    Raises:
        CliError: no ``--set``; an ``--out`` that is a file (or under one); a bad ``--checkpoint``; a random init
            larger than the temporary folder's free space.
    """
    import contextlib

    if not args.sets:
        raise CliError("--set: give at least one grid axis, e.g. --set index_topk=16,32,dense")
    check_out_folder("--out", args.out)
    refuse_adapter_folder(args.checkpoint, "kimi ablate")
    with contextlib.ExitStack() as stack:
        ckpt, _ = materialise_checkpoint(args, stack)
        train_kwargs = {"data": args.data, "stage": args.stage, "lr": args.lr, "seq_len": args.seq_len}
        rows = run_grid(
            ckpt,
            args.sets,
            args.out,
            text=args.text,
            tokens=args.tokens,
            seq_len=args.seq_len,
            backend=args.backend,
            device=args.device,
            train_steps=args.train_steps,
            train_kwargs=train_kwargs,
            quiet=args.quiet,
            restart=args.restart,
        )
    if not args.quiet:
        for r in rows:
            rec = "-" if r["indexer_recall"] is None else f"{r['indexer_recall']:.3f}"
            print(f"{r['cell']:<40} {r['mode']:<8} eval loss {r['eval_loss']:.4f}  recall {rec}")
        print(f"wrote {args.out}/ablate.csv, ablate.json, ablate.png")
    return 0
