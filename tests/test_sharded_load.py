"""Sharded build, load and export on gloo ranks (CPU): a model built on ``meta``, sharded by FSDP2 (the stacked
routed experts ``Shard(0)``: each rank a range of experts) or by hand-made ``DTensor`` placements that cut inside an
expert (rows and columns, a 2-D mesh), materialised with ``to_empty`` and filled by
``kernels_torch.parallel.load.load_sharded``:

* every rank's shards equal the one-process ``kernels_torch.model.load_model`` (bitwise: the same decode and cast);
* each rank reads at most 1.1 x (the stored bytes of what it owns + the largest stored tensor), and its resident
  memory grows by at most 1.1 x (the bytes it owns in the model's dtype + the largest stored tensor) while it
  materialises and loads. The memory is the kernel's own count: ``VmHWM`` of ``/proc/self/status`` (the peak
  resident set, anonymous and file pages alike, so the checkpoint pages a read maps count too), reset just before
  the load by writing ``5`` to ``/proc/self/clear_refs``, minus ``VmRSS`` at that moment. A first, unmeasured load
  of the same model warms every code path (the library pages it touches) and its memory is handed back to the
  system (``malloc_trim``), so the measured load counts only its own pages. The worker fixes glibc's mmap threshold
  at its default 128 kB: left dynamic, the warm-up's frees raise it, the measured load's buffers then come from the
  heap and the pages of freed ones stay resident (fragmentation the allocator keeps, about 3 read pieces here), a
  property of the allocator's history rather than of the load;
* ``kernels_torch.parallel.export.export_sharded`` (every rank its own files) writes the files ``save_model`` writes
  for the same weights, byte for byte (bf16 and MXFP4 experts; also a bf16-experts config), and they load back; the
  same from pipeline ranks that each hold their stage only (pp2, pp2 x dp2).

The checkpoint has a large vocabulary so that the owned bytes dominate what a process touches besides (a few
hundred kB of allocator and library pages).
"""

from __future__ import annotations

import ctypes
import gc
import json
from pathlib import Path

import pytest
import torch
from dist_helpers import run_workers
from helpers import spawn
from torch.distributed.tensor import DTensor

from kimi.config import load_config

SLACK = 1.1  # the bound's factor, on bytes read and on memory
EXPORT_VOCAB = 4096
M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
LAYERS = 3


def _config(quant: bool = True, vocab: int | None = None):
    cfg = load_config("tiny").replace(vocab_size=vocab or 65536, num_experts=16).truncated(LAYERS)
    return cfg if quant else cfg.replace(quant_method=None)


def _write(path: Path, quant: bool = True, vocab: int | None = None) -> Path:
    from kimi.checkpoint import save_params
    from kimi.init import init_params

    cfg = _config(quant, vocab)
    save_params(path, init_params(cfg, seed=3), cfg)
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return _write(tmp_path_factory.mktemp("ckpt") / "k")


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _meta_model(cfg, dtype=torch.float32):
    from kernels_torch.model import KimiK3Model, cast_model

    with torch.device("meta"):
        return cast_model(KimiK3Model(cfg), dtype)


def _stored_owned(model, cfg) -> tuple[int, int]:
    """(stored bytes of the blocks this rank holds, the largest stored tensor's bytes)."""
    from kernels_torch.parallel.load import local_block
    from kimi.arrays import numpy_dtype
    from kimi.layout import stored_layout

    stored = {s.name: s for s in stored_layout(cfg)}
    largest = max(s.numel * numpy_dtype(s.dtype).itemsize for s in stored.values())
    total = 0
    for n, t in model.state_dict(keep_vars=True).items():
        local, _, _ = local_block(model, n, t)
        if ".experts.w" in n:
            per = 0.5 + 1 / cfg.quant_group_size if cfg.quant_method == "mxfp4" else 2
            total += int(local.numel() * per)
        else:
            total += local.numel() * numpy_dtype(stored[n].dtype).itemsize
    return total, largest


def _fsdp_model(cfg, mesh):
    from kernels_torch.parallel.parallelize import parallelize

    model = _meta_model(cfg)
    parallelize(model, mesh)
    return model


def _load_worker(rank: int, world: int, ckpt: str, out: str) -> None:
    from kernels_torch.parallel.load import load_sharded, local_block

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024)  # glibc's default, kept fixed (module docstring)
    from kernels_torch.parallel.fsdp import init_mesh

    cfg = _config()
    mesh = init_mesh(dp=world, cp=1)  # one mesh for both models (its process groups made once)
    warm = _fsdp_model(cfg, mesh)  # warm-up: the same code paths, then its memory handed back
    warm.to_empty(device="cpu")
    load_sharded(warm, ckpt)
    del warm
    gc.collect()
    libc.malloc_trim(0)

    model = _fsdp_model(cfg, mesh)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
    before = _status("VmRSS")
    model.to_empty(device="cpu")
    stats = load_sharded(model, ckpt)
    grown = _status("VmHWM") - before
    stored_owned, largest = _stored_owned(model, cfg)
    owned = sum(t.to_local().numel() * t.element_size() for t in model.state_dict().values())
    shards = {n: t.to_local().clone() for n, t in model.state_dict().items()}
    torch.save(
        {
            "bytes_read": stats.bytes_read,
            "stored_owned": stored_owned,
            "largest": largest,
            "grown": grown,
            "owned": owned,
            "stats_owned": stats.owned_bytes,
            "shards": shards,
            "offsets": {n: local_block(model, n, t)[2] for n, t in model.state_dict(keep_vars=True).items()},
        },
        f"{out}/rank{rank}.pt",
    )


@pytest.mark.distributed
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc peak-RSS reset and glibc")
@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_load_reads_and_holds_only_its_shard(tmp_path, ckpt, world):
    from kernels_torch.model import load_model

    run_workers(_load_worker, world, str(ckpt), str(tmp_path))
    ref = load_model(ckpt).state_dict()
    covered = dict.fromkeys(ref, 0)
    for rank in range(world):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        assert r["owned"] == r["stats_owned"] > 0
        bound_read = SLACK * (r["stored_owned"] + r["largest"])
        assert r["bytes_read"] <= bound_read, (rank, r["bytes_read"], bound_read)
        bound_mem = SLACK * (r["owned"] + r["largest"])
        assert 0 < r["grown"] <= bound_mem, (rank, r["grown"], bound_mem, r["owned"], r["largest"])
        for n, local in r["shards"].items():
            off = r["offsets"][n]
            want = ref[n][tuple(slice(o, o + s) for o, s in zip(off, local.shape))]
            assert torch.equal(local, want), (rank, n)
            covered[n] += local.numel()
    # the experts' stacks are cut by FSDP2 along the experts: each rank read and decoded its own range only
    assert all(covered[n] == ref[n].numel() for n in ref), [n for n in ref if covered[n] != ref[n].numel()]


# ------------------------------------------------------------------------------------ LoRA: the trainer's build


def _lora_build_worker(rank: int, world: int, groups, ckpt: str, out: str) -> None:
    """``kimi train --lora-rank 4`` as torchrun's rank ``rank`` (its environment): the trainer's constructor (build,
    LoRA, sharding, load; data, masters, optimizer) once to warm every code path, its memory handed back, then once
    measured (module docstring)."""
    groups.open()
    torch.set_num_threads(1)
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024)  # glibc's default, kept fixed (module docstring)
    from kernels_torch.parallel.load import local_block
    from kimi.arrays import numpy_dtype
    from kimi.layout import stored_layout
    from kimi_tools.common import DEFAULT_TEXT
    from kimi_tools.train import TrainArgs
    from kimi_tools.train.trainer import Trainer

    kw = dict(
        checkpoint=ckpt, data=[str(DEFAULT_TEXT)], out=f"{out}/run", lora_rank=4, seq_len=32, micro_batch_tokens=32,
        batch_tokens=64, eval_tokens=32, quiet=True, plot=False,
    )  # fmt: skip
    warm = Trainer(TrainArgs(**kw))
    warm.par.barrier()
    del warm
    gc.collect()
    libc.malloc_trim(0)

    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
    before = _status("VmRSS")
    t = Trainer(TrainArgs(**kw))
    grown = _status("VmHWM") - before
    blocks = {n: local_block(t.model, n, x)[0] for n, x in t.model.state_dict(keep_vars=True).items()}
    cfg = _config()
    torch.save(
        {
            "grown": grown,
            "owned": sum(b.numel() * b.element_size() for b in blocks.values()),
            "model": sum(x.numel() * x.element_size() for x in t.model.state_dict().values()),
            "largest": max(s.numel * numpy_dtype(s.dtype).itemsize for s in stored_layout(cfg)),
            "adapters": sum(b.numel() for n, b in blocks.items() if ".lora_" in n),
        },
        f"{out}/lora{rank}.pt",
    )
    t.par.close()  # a barrier, then the group torn down


@pytest.mark.distributed
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc peak-RSS reset and glibc")
def test_lora_run_builds_and_loads_only_its_shard(tmp_path, ckpt):
    """Under torchrun a LoRA run is built on ``meta`` and each rank loads its own shards, as full fine-tuning: the
    trainer's constructor grows each rank's resident memory by at most 1.1 x (the bytes it owns, base and adapters,
    + the largest stored tensor). Built whole on every rank before the sharding, a rank grows by 2.5 x that bound here."""
    world = 2
    spawn(_lora_build_worker, world, str(ckpt), str(tmp_path))
    for rank in range(world):
        r = torch.load(tmp_path / f"lora{rank}.pt")
        assert r["adapters"] > 0 and r["owned"] < 0.6 * r["model"], r
        bound = SLACK * (r["owned"] + r["largest"])
        assert 0 < r["grown"] <= bound, (rank, r["grown"], bound, r["owned"], r["largest"], r["model"])


# ------------------------------------------------------------------------------------ placements cutting an expert


def _cut_worker(rank: int, world: int, ckpt: str, out: str) -> None:
    """A 2 x 2 mesh; every parameter a DTensor: stacks [E, out, in] Shard(1) x Shard(2) (each rank a quarter of every
    expert; w2 [64, 96] cut at column 48, inside an MXFP4 group of 32), matrices Shard(0) x Shard(1), vectors
    Replicate x Shard(0)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from kernels_torch.moe import GroupedExperts
    from kernels_torch.parallel.load import load_sharded

    cfg = _cut_config()
    mesh = init_device_mesh("cpu", (2, 2))
    model = _meta_model(cfg)
    for mod in model.modules():
        for n, p in list(mod.named_parameters(recurse=False)):
            if isinstance(mod, GroupedExperts):
                pl = [Shard(1), Shard(2)]
            elif p.ndim >= 2:
                pl = [Shard(0), Shard(1)]
            else:
                pl = [Replicate(), Shard(0)]
            mod.register_parameter(n, torch.nn.Parameter(distribute_tensor(p, mesh, pl), p.requires_grad))
    model.to_empty(device="cpu")
    stats = load_sharded(model, ckpt)
    from kernels_torch.parallel.load import local_block

    torch.save(
        {
            "bytes_read": stats.bytes_read,
            "shards": {n: local_block(model, n, t) for n, t in model.state_dict(keep_vars=True).items()},
        },
        f"{out}/cut{rank}.pt",
    )


def _cut_config():
    return _config().replace(moe_intermediate_size=96, vocab_size=512)


@pytest.mark.distributed
def test_load_into_blocks_cut_inside_experts(tmp_path):
    """Every rank's blocks equal the one-process model's, experts cut by rows and by columns (inside a group)."""
    from kernels_torch.model import load_model
    from kimi.checkpoint import save_params
    from kimi.init import init_params

    ckpt = tmp_path / "k"
    cfg = _cut_config()
    save_params(ckpt, init_params(cfg, seed=4), cfg)
    run_workers(_cut_worker, 4, str(ckpt), str(tmp_path))
    ref = load_model(ckpt).state_dict()
    cuts = set()
    for rank in range(4):
        r = torch.load(tmp_path / f"cut{rank}.pt")
        for n, (local, gshape, off) in r["shards"].items():
            assert gshape == tuple(ref[n].shape), n
            want = ref[n][tuple(slice(o, o + s) for o, s in zip(off, local.shape))]
            assert torch.equal(local, want), (rank, n)
            if ".experts.w2" in n:
                cuts.add(off[2] % cfg.quant_group_size)
    assert cuts == {0, 48 % cfg.quant_group_size}, cuts  # a column block starting inside an MXFP4 group


def _ep_worker(rank: int, world: int, ckpt: str, out: str) -> None:
    from kernels_torch.parallel.expert import shard_experts
    from kernels_torch.parallel.load import load_sharded

    model = _meta_model(_cut_config())
    shard_experts(model)  # plain tensors: each rank's stacks hold experts [r E / 2, (r + 1) E / 2)
    model.to_empty(device="cpu")
    stats = load_sharded(model, ckpt)
    torch.save({"sd": model.state_dict(), "bytes_read": stats.bytes_read}, f"{out}/ep{rank}.pt")


@pytest.mark.distributed
def test_load_into_expert_parallel_ranges(tmp_path):
    """``kernels_torch.parallel.expert.shard_experts`` (plain stacks of a range of experts): each rank reads and
    holds its own experts only, equal to the one-process model's rows."""
    from kernels_torch.model import load_model
    from kimi.checkpoint import save_params
    from kimi.init import init_params

    cfg = _cut_config()
    save_params(tmp_path / "k", init_params(cfg, seed=9), cfg)
    run_workers(_ep_worker, 2, str(tmp_path / "k"), str(tmp_path))
    ref = load_model(tmp_path / "k").state_dict()
    E = cfg.num_experts
    for rank in range(2):
        got = torch.load(tmp_path / f"ep{rank}.pt")
        for n, t in got["sd"].items():
            t = t.to_local() if isinstance(t, DTensor) else t  # the expert stacks: DTensors Shard(0) over ep
            want = ref[n][rank * E // 2 : (rank + 1) * E // 2] if ".experts.w" in n else ref[n]
            assert torch.equal(t, want), (rank, n)
        assert got["bytes_read"] < sum(p.stat().st_size for p in (tmp_path / "k").glob("*.safetensors"))


# ------------------------------------------------------------------------------------------------ parallel export


def _export_worker(rank: int, world: int, ckpt: str, out: str, max_bytes: int) -> None:
    from kernels_torch.parallel.export import export_sharded
    from kernels_torch.parallel.fsdp import init_mesh
    from kernels_torch.parallel.load import load_sharded
    from kimi.config import KimiConfig

    cfg = KimiConfig.from_json(Path(ckpt) / "config.json")
    model = _fsdp_model(cfg, init_mesh(dp=world, cp=1))
    model.to_empty(device="cpu")
    load_sharded(model, ckpt)
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():  # fp32 weights that are no round trip of the stored ones: the cast and quantiser act
        for p in model.parameters():
            local = p.to_local()
            local.mul_(1.0 + 0.3 * torch.rand(local.shape, generator=g, dtype=local.dtype))
    wrote = export_sharded(model, f"{out}/par", max_shard_bytes=max_bytes)
    export_sharded(model, f"{out}/par_default")  # one 5 GB file: save_model's own layout
    sd = {n: t.full_tensor() for n, t in model.state_dict().items()}
    if rank == 0:
        torch.save(sd, f"{out}/full.pt")
    (Path(out) / f"wrote{rank}.json").write_text(json.dumps(wrote))


@pytest.mark.distributed
@pytest.mark.parametrize("world, quant", [(2, True), (4, True), (2, False)], ids=["w2-mxfp4", "w4-mxfp4", "w2-bf16"])
def test_parallel_export_equals_single_process(tmp_path, world, quant):
    from kernels_torch.model import KimiK3Model, cast_model

    ckpt = _write(tmp_path / "k", quant, EXPORT_VOCAB)
    max_bytes = 2**18  # several files: every rank writes some
    run_workers(_export_worker, world, str(ckpt), str(tmp_path), max_bytes)
    cfg = _config(quant, EXPORT_VOCAB)
    one = cast_model(KimiK3Model(cfg), torch.float32)
    one.load_state_dict(torch.load(tmp_path / "full.pt"))
    _assert_export_equals(tmp_path, one, max_bytes, world)


def _assert_export_equals(out: Path, one, max_bytes: int, world: int) -> None:
    """The ranks' exports in ``out`` (``par``: files of ``max_bytes``, ``par_default``: the default size, and what
    each rank wrote, ``wrote{rank}.json``) equal, byte for byte, the one-process model ``one`` written by
    ``save_model`` (``par_default``) and by its ``save_params`` with the same file size (``par``); every rank wrote
    files and they load back equal."""
    from kernels_torch.model import load_model, save_model
    from kernels_torch.params import canonical_state_dict
    from kimi.checkpoint import CheckpointReader, save_params
    from kimi.layout import param_layout

    cfg = one.config
    dtypes = {s.name: getattr(torch, s.dtype) for s in param_layout(cfg)}
    sd = {k: v.detach().to("cpu", dtypes[k]) for k, v in canonical_state_dict(one).items()}
    save_params(out / "one", sd, cfg, max_shard_bytes=max_bytes)  # save_model with the same file size
    par, ref = out / "par", out / "one"
    names = sorted(p.name for p in ref.iterdir())
    assert names == sorted(p.name for p in par.iterdir())  # no temporary file left
    wrote = [json.loads((out / f"wrote{r}.json").read_text()) for r in range(world)]
    assert all(wrote), wrote  # every rank wrote files
    for name in names:
        assert (par / name).read_bytes() == (ref / name).read_bytes(), name
    back = load_model(par).state_dict()
    for k, v in load_model(ref).state_dict().items():
        assert torch.equal(back[k], v), k
    assert len(CheckpointReader(par).files) >= world
    save_model(one, out / "sm")
    for name in sorted(p.name for p in (out / "sm").iterdir()):
        assert (out / "par_default" / name).read_bytes() == (out / "sm" / name).read_bytes(), name


def _pp_config():
    """4 layers in AttnRes blocks of 2 (pp2 cuts between them), MXFP4 experts, a small vocabulary."""
    return load_config("tiny").replace(vocab_size=EXPORT_VOCAB, num_experts=16, attn_res_block_size=2).truncated(4)


def _pp_model(dtype: str):
    from kernels_torch.model import KimiK3Model, cast_model

    torch.manual_seed(7)  # every rank and the test build the same weights (no round trip of bf16: casts act)
    return cast_model(KimiK3Model(_pp_config()), getattr(torch, dtype))


def _pp_export_worker(rank: int, world: int, out: str, dp: int, dtype: str, max_bytes: int) -> None:
    """pp2 (x dp): each rank keeps its stage (FSDP2-sharded over dp when dp > 1) and exports
    ``Pipeline.rank_module()``; records what it holds, wrote and the largest block it gathered; then the same view
    without ``lm_head`` must be refused on every rank, naming the tensor."""
    from torch.distributed.device_mesh import init_device_mesh

    import kernels_torch.parallel.export as export
    from kernels_torch.parallel.pipeline import Pipeline, shard_stages

    pp = world // dp
    mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
    pipe = Pipeline(
        _pp_model(dtype),
        pp_size=pp,
        pp_rank=mesh["pp"].get_local_rank(),
        n_microbatches=pp,
        group=mesh["pp"].get_group(),
    )
    if dp > 1:
        shard_stages(pipe, mesh["dp"])
    view = pipe.rank_module()
    held = {n: t.to_local().numel() if isinstance(t, DTensor) else t.numel() for n, t in view.state_dict().items()}
    gathered = []
    gather = export.gather_block

    def counting(*args, **kwargs):
        t = gather(*args, **kwargs)
        gathered.append(0 if t is None else t.numel())
        return t

    export.gather_block = counting  # export_sharded looks it up in its module
    try:
        wrote = export.export_sharded(view, f"{out}/par", max_shard_bytes=max_bytes)
        export.export_sharded(view, f"{out}/par_default")
    finally:
        export.gather_block = gather
    if hasattr(view, "lm_head"):
        del view.lm_head  # now no rank holds lm_head.weight
    try:
        export.export_sharded(view, f"{out}/missing")
        refused = ""
    except ValueError as e:
        refused = str(e)
    record = {"held": held, "wrote": wrote, "largest_gathered": max(gathered), "refused": refused}
    (Path(out) / f"wrote{rank}.json").write_text(json.dumps(wrote))
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(record))


@pytest.mark.distributed
@pytest.mark.parametrize("dp, dtype", [(1, "float64"), (2, "float32")], ids=["pp2-fp64", "pp2-dp2-fp32"])
def test_pipeline_export_equals_single_process(tmp_path, dp, dtype):
    """``export_sharded`` of each rank's ``Pipeline.rank_module()`` at pp2 (plain tensors, each whole on one rank)
    in fp64 (a writer without the tensor receives the holders' dtype) and pp2 x dp2 in fp32 (``DTensor``\\ s over
    each stage's dp ranks): ``save_model``'s files of the one-process model byte for byte, written by every rank; a
    rank holds its stage only (some tensors, never all) and gathers at most one canonical tensor at a time; a tensor
    no rank holds (``lm_head`` dropped) is refused on every rank by name."""
    from kimi.layout import param_layout, stacked_layout

    world, max_bytes = 2 * dp, 2**16
    run_workers(_pp_export_worker, world, str(tmp_path), dp, dtype, max_bytes)
    _assert_export_equals(tmp_path, _pp_model(dtype), max_bytes, world)
    cfg = _pp_config()
    layout = {s.name: s.numel for s in stacked_layout(cfg)}
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    union = set()
    for r, rec in enumerate(records):
        assert set(rec["held"]) < set(layout), r  # a stage's tensors: some of the model's, never all
        union |= set(rec["held"])
        if dp > 1:  # FSDP2 over dp: a shard of each
            assert sum(rec["held"].values()) < sum(layout[n] for n in rec["held"]), r
        assert rec["largest_gathered"] <= max(s.numel for s in param_layout(cfg)), r
        assert "missing from the model: lm_head.weight" in rec["refused"], (r, rec["refused"])
    assert union == set(layout)


# ------------------------------------------------------------------------------------------------ kimi train


@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_train_from_checkpoint_loads_shards_and_exports(tmp_path):
    """``kimi train --checkpoint`` on 2 torchrun ranks (the model built on meta, each rank reading its shards, the
    export written by both ranks) gives the one-process losses and gradient norms, and its exported model equals
    the one-process one within the bf16 tolerance of ``tests/test_train_parallel.py``."""
    from safetensors.torch import load_file
    from test_train_parallel import (
        COMMON,
        TOL,
        _assert_same,
        _close,
        _records,
        _short_documents,
        _torchrun,
        assert_exports_close,
    )

    from kimi.checkpoint import save_params
    from kimi.init import init_params
    from kimi_tools.cli import main

    cfg = load_config("tiny").truncated(4)
    ckpt = tmp_path / "ck"
    save_params(ckpt, init_params(cfg, seed=5), cfg)
    data = _short_documents(tmp_path / "docs.jsonl")
    argv = [a for a in COMMON if a not in ("--preset", "tiny", "--layers", "4")]
    argv += ["--checkpoint", str(ckpt), "--data", str(data)]
    assert main(["train", *argv, "--out", str(tmp_path / "one")]) == 0
    r = _torchrun(2, [*argv, "--out", str(tmp_path / "two")])
    assert r.returncode == 0, r.stderr[-3000:]
    want, got = _records(tmp_path / "one"), _records(tmp_path / "two")
    _assert_same(got, want, (1, 2, 3))
    assert _close(got[0]["eval_loss"], want[0]["eval_loss"], TOL["eval_loss"])
    a, b = load_file(tmp_path / "two" / "model.safetensors"), load_file(tmp_path / "one" / "model.safetensors")
    assert a.keys() == b.keys()
    assert_exports_close(a, b)


# ------------------------------------------------------------------------------------------------ one process


def test_read_canonical_block_equals_whole_read(tmp_path):
    """Random blocks of every canonical tensor (experts cut at any row and column, inside MXFP4 groups; A_log; conv
    weights stored in the [C, W] variant) equal the same block of ``load_arrays``, and read fewer bytes than the
    whole tensors."""
    import numpy as np
    from test_checkpoint import write_raw

    from kimi.checkpoint import CheckpointReader, load_arrays, read_canonical_block, to_stored
    from kimi.init import init_params
    from kimi.layout import param_layout

    cfg = load_config("tiny").truncated(3)
    stored = to_stored(init_params(cfg, seed=6), cfg)  # torch tensors
    convs = [k for k in stored if k.endswith("_conv1d.weight")]
    assert convs
    for k in convs:
        stored[k] = stored[k][:, 0, :].contiguous()  # [C, 1, W] -> [C, W], as some exporters store it (spec 2.1)
    write_raw(tmp_path / "k", stored, cfg)
    whole = load_arrays(tmp_path / "k")
    reader = CheckpointReader(tmp_path / "k")
    rng = np.random.default_rng(0)
    for spec in param_layout(cfg):
        block = []
        for n in spec.shape:
            a = int(rng.integers(0, n))
            block.append((a, int(rng.integers(a + 1, n + 1))))
        got = read_canonical_block(reader, cfg, spec, tuple(block))
        want = whole[spec.name][tuple(slice(a, b) for a, b in block)]
        assert got.dtype == want.dtype and np.array_equal(got, want), (spec.name, block)
    stored = sum((tmp_path / "k" / f).stat().st_size for f in reader.files)
    assert 0 < reader.bytes_read < stored


def test_load_sharded_errors_and_buffers(tmp_path):
    """A tensor missing from the model or of another shape is named with both shapes; a non-persistent buffer is
    recomputed by its module's reset_buffers() or refused."""
    from kernels_torch.parallel.load import load_sharded
    from kimi.checkpoint import save_params
    from kimi.init import init_params

    cfg = load_config("tiny").truncated(2)
    save_params(tmp_path / "k", init_params(cfg, seed=7), cfg)

    class Cache(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)

    class Recomputed(Cache):
        def reset_buffers(self):
            self.inv_freq.copy_(torch.arange(4.0))

    model = _meta_model(cfg)
    model.model.cache = Recomputed()
    model.to_empty(device="cpu")
    load_sharded(model, tmp_path / "k")
    assert torch.equal(model.model.cache.inv_freq, torch.arange(4.0))
    model.model.cache = Cache()
    with pytest.raises(ValueError, match=r"non-persistent buffers \['inv_freq'\]"):
        load_sharded(model, tmp_path / "k")
    del model.model.cache
    model.model.norm.weight = torch.nn.Parameter(torch.zeros(7))
    with pytest.raises(ValueError, match=r"wrong shape: model.norm.weight \(checkpoint layout \[96\], model \[7\]\)"):
        load_sharded(model, tmp_path / "k")
    del model.lm_head
    with pytest.raises(ValueError, match=r"missing from the model: lm_head.weight"):
        load_sharded(model, tmp_path / "k")
    model = _meta_model(cfg)
    with pytest.raises(ValueError, match="on the meta device: model.embed_tokens.weight"):
        load_sharded(model, tmp_path / "k")


def test_load_sharded_refuses_nonfinite_and_layout_problems(tmp_path):
    from test_checkpoint import write_raw

    from kernels_torch.parallel.load import load_sharded
    from kimi.checkpoint import CheckpointError, to_stored
    from kimi.init import init_params

    cfg = load_config("tiny").truncated(2)
    stored = to_stored(init_params(cfg, seed=8), cfg)
    stored["model.norm.weight"] = stored["model.norm.weight"].clone()
    stored["model.norm.weight"][5] = float("nan")
    write_raw(tmp_path / "nan", stored, cfg)
    model = _meta_model(cfg)
    model.to_empty(device="cpu")
    with pytest.raises(CheckpointError, match=r"non-finite: model.norm.weight block \[\(0, 96\)\]: 1 NaN"):
        load_sharded(model, tmp_path / "nan")
    load_sharded(model, tmp_path / "nan", check_finite=False)
    stored.pop("model.layers.1.post_attention_layernorm.weight")
    write_raw(tmp_path / "missing", stored, cfg)
    with pytest.raises(CheckpointError, match=r"missing: model.layers.1.post_attention_layernorm.weight"):
        load_sharded(model, tmp_path / "missing")


def test_to_empty_keeps_parameter_objects():
    """``load.to_empty`` materialises a meta model with the same parameter objects (``Module.to_empty`` makes new
    ones, leaving references taken before on the discarded meta tensors)."""
    from kernels_torch.parallel.load import to_empty

    cfg = load_config("tiny").truncated(2)
    model = _meta_model(cfg)
    before = dict(model.named_parameters())
    to_empty(model, "cpu")
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for n, p in after.items():
        assert p is before[n] and p.device.type == "cpu" and isinstance(p, torch.nn.Parameter), n
