"""One rank of a planned cluster, built by the trainer's own code on a fake process group, against the planner's
memory and time (``docs/scaling.md`` section 7).

For each run (``--runs full lora``): full fine-tuning on the smallest cluster of ``--clusters`` where ``kimi plan``
finds a layout that fits, LoRA (rank ``--lora-rank``) on ``--lora-gpus``; the first fitting row (the plan's best).
The row's own ``torchrun ... kimi train ...`` command (``kimi_tools.plan.train_command``) is parsed by ``kimi
train``'s parser, so the rank runs the policy the planner chose, and the rank is built as the trainer builds one:

* ``torch.distributed`` initialised in this one process with torch's fake backend (``FakeStore``, world size the
  layout's ``pp x dp x cp``, this process the first rank of the worst pipeline stage): every process group and
  DeviceMesh has the layout's real sizes;
* the model on ``meta``, LoRA applied, then ``TrainParallel.setup`` (``kernels_torch.parallel.parallelize``):
  expert parallelism, the pipeline stage split, recomputation / activation offload, FSDP2 with the policy's mixed
  precision, masters, reduce dtype, reshard and parameter offload; then the rank's shards allocated (``to_empty``)
  and filled with random values, the trainer's masters and optimizer (``MasterWeights``, ``build_optimizer``).
  The memory is therefore the trainer's: the rank's FSDP2 shards, masters, gradients and optimizer states at the
  planned sizes, the gathered copies and reduce buffers FSDP2 allocates, the activations the policy keeps.

The fake backend moves no data, so the rehearsal stands in for the network where values matter
(:class:`LocalAllGather`, :class:`LocalReduceScatter`, :class:`LoopbackExperts`): an FSDP2 all-gather fills every
rank's slot with this rank's shard (the weights are random anyway), a reduce-scatter keeps this rank's slot, and the
expert all-to-all returns each row to its sender, so that this rank's local expert ``e`` receives the rows its own
tokens routed to expert ``e`` of every rank: ``T k ep / E`` rows per expert on average, the count the real
all-to-all delivers when every rank routes alike. Those stand-ins are copies on the device: the measured time is the
stage's compute plus those copies, never the network's. Context parallelism (``cp`` > 1) exchanges key/value state
whose values matter: not rehearsed (refused); nor are the V schedules' ranks, which hold two stages each (refused).

Run: the ``min(pp - s, m)`` micro-batches stage ``s`` holds in flight under 1F1B run their forwards, then their
backwards; one more micro-batch is timed alone (under ``--offload cpu``, but for ``--pp-fsdp stage``, each
backward is followed by the trainer's take of the host gradients out of ``.grad``,
``kernels_torch.parallel.fsdp.HostGradSums``); then the optimizer step (the trainer's ``grads_to_masters``,
``step_optimizer``, ``to_model``). The first stage takes token ids, a later one a random received state ``[M, 1,
T, D]``; a stage before the last returns the state it sends and gets a random gradient of it; the last stage ends
with the summed NLL. Writes one JSON (``--out``): the layout, the command, the planner's prediction beside the
measurement (peak memory on CUDA, ``null`` on CPU; the timed micro-batch against the planner's compute plus its
offload costs per micro-batch; the optimizer step's seconds), their ratio, the predicted cluster tokens/s per GPU
and MFU. ``--profile`` adds the timed micro-batch's heaviest operators (``torch.profiler``).

    python benchmarks/rank_rehearsal.py --seq-len 8192 --out benchmarks/results/rank_rehearsal.json
    python benchmarks/rank_rehearsal.py --preset tiny --device cpu --clusters 4 --lora-gpus 4 --gpu-memory 1  # smoke
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

if str(Path(__file__).resolve().parent.parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kimi.config import load_config  # noqa: E402
from kimi_tools import plan as P  # noqa: E402


def choose(
    preset: str, gpus: int, seq_len: int, lora_rank: int | None, gpu_memory: float, host_memory: float = 250.0
) -> dict | None:
    """The best fitting layout of ``kimi plan`` on ``gpus`` GPUs that :func:`rehearse` runs (no context
    parallelism, one stage per rank: no V schedule), or None; ``host_memory``: GB of host memory the rank may use
    (offloaded states)."""
    args = P._args(gpus, lora_rank, seq_len=seq_len, preset=preset, gpu_memory=gpu_memory, reserve=0.05 * gpu_memory,
                   host_memory=host_memory)  # fmt: skip
    rows, _ = P.run_plan(args)
    runs = (r for r in rows if r["fits"] and r["layout"]["cp"] == 1 and len(r.get("worst_rank_stages", ())) <= 1)
    return next(runs, None)


def available_host_gb() -> float:
    """This machine's available memory in GB (``MemAvailable`` of ``/proc/meminfo``; 250 where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return 250.0


def train_args(row: dict, device: str, out: str):
    """``kimi train``'s resolved ``TrainArgs`` of ``row["command"]`` (the planner's launch line), on ``device``: on
    ``cpu`` the ``eager`` backend replaces ``cudnn`` (the same layout and policy, bf16)."""
    from kimi_tools.train.args import TrainArgs, add_arguments, args_from_namespace, resolve

    argv = shlex.split(row["command"])
    argv = argv[argv.index("train") + 1 :]
    swap = {"--out": out, "--data": out, "--device": device}
    if device == "cpu":
        swap["--backend"] = "eager"
    argv = [swap.get(argv[i - 1], a) if i else a for i, a in enumerate(argv)]
    ap = argparse.ArgumentParser()
    add_arguments(ap, TrainArgs)
    return resolve(args_from_namespace(ap.parse_args(argv)))


class LocalAllGather(AllGather):
    """FSDP2's all-gather on the fake group: every rank's slot of the output holds this rank's shard (a device copy;
    ``FSDPModule.set_custom_all_gather``)."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        n = input_tensor.numel()
        output_tensor.view(-1, n).copy_(input_tensor.clone().view(1, n).expand(output_tensor.numel() // n, n))
        return None


class LocalReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter on the fake group: this rank's slot of the input (a device copy;
    ``FSDPModule.set_custom_reduce_scatter``)."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        n = output_tensor.numel()
        output_tensor.copy_(input_tensor.view(-1, n)[dist.get_rank(group)])
        return None


class _Done:
    """The handle of a loopback transfer (already done)."""

    def wait(self, timeout=None) -> bool:
        return True


class LoopbackExperts:
    """The expert all-to-all of a rank whose peers route as it does: every ``all_to_all_single`` returns its input
    (``output_split_sizes`` equal to ``input_split_sizes``), so the per-expert counts a rank receives are those it
    sends and its local expert ``e`` computes the rows its tokens routed to expert ``e`` of each rank. Installed in
    ``kernels_torch.parallel.expert`` for the rehearsal's duration (:meth:`installed`)."""

    def __getattr__(self, name):  # everything else of torch.distributed as it is
        return getattr(dist, name)

    @staticmethod
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        output.copy_(input)
        return _Done() if async_op else None

    @staticmethod
    def all_to_all(x, output_split_sizes, input_split_sizes, group):
        return x.clone()  # differentiable identity: its gradient comes back the same way

    @classmethod
    @contextlib.contextmanager
    def installed(cls):
        from kernels_torch.parallel import expert

        saved = expert.dist, expert.all_to_all
        expert.dist, expert.all_to_all = cls(), cls.all_to_all
        try:
            yield
        finally:
            expert.dist, expert.all_to_all = saved


@contextlib.contextmanager
def fake_group(world: int, rank: int):
    """``torch.distributed`` on torch's fake backend: ``world`` ranks, this process ``rank``; destroyed after."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _fill_random(module: torch.nn.Module, device: str) -> None:
    """Random values in the rank's local shards, in the ranges the model's weights have (as
    ``benchmarks/train_step_4layers.py``): only the ranges matter here."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for name, p in module.named_parameters():
            t = p.to_local() if isinstance(p, DTensor) else p
            # host shards (--offload cpu: tens of GB at real size) are drawn on the GPU and copied, minutes faster
            draw = torch.empty_like(t, device=device) if t.device.type != device else t
            if name.endswith("A_log"):
                draw.uniform_(0.0, 2.0)
            elif name.endswith("lora_B.weight"):
                draw.normal_(0.0, 1e-3)
            elif p.ndim >= 2:
                draw.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)
            elif name.endswith(("dt_bias", "e_score_correction_bias", "k_norm.bias")):
                draw.normal_(0.0, 0.01)
            else:
                draw.fill_(1.0)
            if draw is not t:
                t.copy_(draw)


def _local_bytes(tensors) -> int:
    """Bytes this rank holds of ``tensors`` (a DTensor's local shard only)."""
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


def _states(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's state tensors of more than one element (moments; not the step counters)."""
    return [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.numel() > 1]


def build_rank(a, row: dict):
    """The rank of ``row`` built by the trainer's code for the resolved ``TrainArgs`` ``a`` (the fake group is
    initialised): returns ``(TrainParallel, module, MasterWeights, optimizer)``, the shards materialised and filled."""
    from torch.distributed.fsdp import FSDPModule

    from kernels_torch.parallel.load import to_empty
    from kimi_tools.train.parallel import TrainParallel
    from kimi_tools.train.trainer import _lora_settings
    from kimi_tools.train.weights import MasterWeights, _plain_to, build_model, build_optimizer, convert_model

    par = TrainParallel.from_args(a, world=row["layout"]["world"])
    cfg = load_config(a.preset)
    model = build_model(a, cfg, meta=True)
    lora = _lora_settings(a) if a.lora_rank is not None else None
    if lora is not None:
        from kimi_tools.lora import apply_lora

        apply_lora(model, lora)
    convert_model(model, a)
    par.setup(model, lora=lora is not None, args=a)
    module = par.module
    roots = [module] + (list(par.pipe.stages) if par.pipe is not None else [])
    for m in {id(m): m for r in roots for m in r.modules() if isinstance(m, FSDPModule)}.values():
        m.set_custom_all_gather(LocalAllGather())
        m.set_custom_reduce_scatter(LocalReduceScatter())
    offload = a.offload == "cpu" and a.device != "cpu"
    to_empty(module, "cpu" if offload else a.device)
    if offload:
        _plain_to(module, a.device)
    _fill_random(module, a.device)
    masters = MasterWeights(module, low_precision=a.optimizer == "adamw-bf16", replicated=par.replicated)
    return par, module, masters, build_optimizer(masters, a)


# the project's own packages: a live allocation is charged to its innermost frame in one of them
PROJECT_DIRS = ("kernels_torch/", "kimi_tools/", "kimi/", "benchmarks/")


def live_by_place(snapshot: dict, top: int = 15) -> list[dict]:
    """The live CUDA allocations of ``snapshot`` (``torch.cuda.memory._snapshot()`` with the history recorded,
    "Understanding CUDA Memory Usage" in torch's docs) grouped by where they were made: the innermost stack frame in
    :data:`PROJECT_DIRS` (``"kernels_torch/moe.py:120 forward"``), else the innermost frame, else ``"unrecorded"``
    (allocated while no history was kept). Returns ``[{"place", "gb", "blocks"}]``, the ``top`` largest, GB = 1e9 B."""
    by: dict[str, list[int]] = {}
    for seg in snapshot.get("segments", []):
        for block in seg.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            frames = block.get("frames") or []
            place = "unrecorded"
            for f in frames:
                name = f.get("filename", "")
                hit = next((name[name.rindex(d) :] for d in PROJECT_DIRS if d in name), None)
                if hit is not None:
                    place = f"{hit}:{f.get('line')} {f.get('name')}"
                    break
            else:
                if frames:
                    place = f"{frames[0].get('filename')}:{frames[0].get('line')} {frames[0].get('name')}"
            acc = by.setdefault(place, [0, 0])
            acc[0] += block["size"]
            acc[1] += 1
    rows = sorted(by.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"place": k, "gb": v[0] / 1e9, "blocks": v[1]} for k, v in rows]


@contextlib.contextmanager
def _profiled(on: bool):
    """``torch.profiler`` over CPU and CUDA activities while ``on``, else nothing (yields ``None``)."""
    if not on:
        yield None
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        yield prof


def profile_tables(prof, top: int = 25) -> dict:
    """The timed micro-batch's operators from a ``torch.profiler`` run: the ``top`` by self CUDA time and by self CPU
    time, each ``{"name", "calls", "self_cuda_ms", "self_cpu_ms"}``, and the totals (ms): where a step slower than
    the planner's spends its time (kernels, host copies, or the host itself)."""
    events = prof.key_averages()

    def row(e) -> dict:
        cuda_us = getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
        return {
            "name": e.key,
            "calls": e.count,
            "self_cuda_ms": cuda_us / 1e3,
            "self_cpu_ms": e.self_cpu_time_total / 1e3,
        }

    rows = [row(e) for e in events]
    return {
        "self_cuda_ms_total": sum(r["self_cuda_ms"] for r in rows),
        "self_cpu_ms_total": sum(r["self_cpu_ms"] for r in rows),
        "by_cuda": sorted(rows, key=lambda r: -r["self_cuda_ms"])[:top],
        "by_cpu": sorted(rows, key=lambda r: -r["self_cpu_ms"])[:top],
    }


def _decoder_layers(module: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """``(model index, layer)`` of the decoder layers under ``module``: the first ``layers`` container (a whole
    model's ``model.layers`` list, or a pipeline stage's ``ModuleDict`` keyed by the model index)."""
    for name, layers in module.named_modules():
        if name.split(".")[-1] == "layers" and isinstance(layers, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            return [(int(k), m) for k, m in layers.items()] if hasattr(layers, "items") else list(enumerate(layers))
    return []


def track_phases(module: torch.nn.Module, progress: dict, cuda: bool) -> list:
    """Name the rehearsal's phase per decoder layer and the head in ``progress["phase"]``, so that an out-of-memory
    error names the layer: ``"<step> layer i"`` when layer ``i``'s forward starts (``<step>`` the phase the
    rehearsal set, e.g. ``forward 0``), ``"<step> backward layer i"`` when its gradient arrives (its recomputation,
    which reruns the layer's forward without the module's hooks, included), ``"<step> head"`` from the final norm on
    (the output and the loss). On CUDA each change appends ``[phase, allocated, peak so far]`` (bytes:
    ``torch.cuda.memory_allocated`` and ``max_memory_allocated`` as the new phase starts) to ``progress["trail"]``:
    the peak grew in the phase before the row where it changed. Returns the hook handles."""
    progress.setdefault("trail", [])

    def mark(name: str) -> None:
        step = progress.get("step", progress.get("phase", ""))
        progress["phase"] = f"{step} {name}"
        if cuda:
            progress["trail"].append(
                [progress["phase"], torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()]
            )

    handles = []
    for i, layer in _decoder_layers(module):

        def pre(mod, args, i=i):
            mark(f"layer {i}")

        def bpre(mod, grad, i=i):
            mark(f"backward layer {i}")

        handles.append(layer.register_forward_pre_hook(pre))
        handles.append(layer.register_full_backward_pre_hook(bpre))
    norms = [m for name, m in module.named_modules() if name.split(".")[-1] == "norm" and name.count(".") <= 1]
    if norms:  # the final norm: the head (output mix done, the loss next)
        handles.append(norms[0].register_forward_pre_hook(lambda mod, args: mark("head")))
    return handles


def rehearse(
    preset: str,
    row: dict,
    device: str,
    lora_rank: int | None = None,
    seed: int = 0,
    progress: dict | None = None,
    memory_history: bool = False,
    profile: bool = False,
) -> dict:
    """Build the rank of ``row`` (a ``kimi plan`` layout; ``lora_rank`` is read from its command) on ``device``,
    run its in-flight micro-batches' forwards and backwards and one optimizer step, and return the prediction
    beside the measurement (bytes, milliseconds). ``progress`` (a dict, filled as it goes): ``phase`` (``build``,
    ``forward N``, ``backward N``, ``timed``, ``optimizer``; within a step the decoder layer, :func:`track_phases`)
    and, on CUDA, ``after_build_bytes`` (allocated once the rank is built: its parameters and whatever it keeps) and
    ``trail`` (allocated and peak bytes as each phase starts), so that an out-of-memory error says where it came.
    ``memory_history`` (CUDA): record each allocation's Python stack (``torch.cuda.memory._record_memory_history``)
    from the build through the in-flight micro-batches, stopped before the timed one (the recording slows the host),
    so that an out-of-memory error's live blocks can be charged to their places (:func:`live_by_place`).

    Raises:
        ValueError: a layout with ``cp`` > 1 (not rehearsed: module docstring)."""
    from kernels_torch.parallel.pipeline import sources_after
    from kimi_tools.train.weights import step_optimizer

    L = row["layout"]
    if L["cp"] > 1:
        raise ValueError(f"rank_rehearsal: layout cp {L['cp']}: context parallelism is not rehearsed (expected cp 1)")
    if len(row.get("worst_rank_stages", ())) > 1:  # a V schedule: the rank holds stages r and 2 pp - 1 - r
        raise ValueError(
            f"rank_rehearsal: schedule {row.get('schedule')}: the rank holds stages {row['worst_rank_stages']}, and "
            "the rehearsal runs one stage per rank (expected a schedule with one stage per rank: 1F1B, or pp 1)"
        )
    torch.manual_seed(seed)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    s = row["worst_stage"]
    progress = {} if progress is None else progress
    progress["phase"] = progress["step"] = "build"
    if memory_history and cuda:
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=100_000)
    with tempfile.TemporaryDirectory() as tmp, fake_group(L["world"], s * L["dp"] * L["cp"]):
        a = train_args(row, device, tmp)
        cfg = load_config(a.preset)
        t_build = time.perf_counter()
        par, module, masters, optimizer = build_rank(a, row)
        print(f"rank built in {time.perf_counter() - t_build:.0f} s", flush=True)
        if cuda:  # the step's peak from here: the build's transient buffers (the drawn shards) released
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            progress["after_build_bytes"] = torch.cuda.memory_allocated()
        stage = par.pipe.stages[0] if par.pipe is not None else None
        track_phases(module if stage is None else stage, progress, cuda)
        T, D = row["tokens_per_microbatch_per_rank"], cfg.hidden_size
        inflight = min(L["pp"] - s, row["microbatches"])
        first = stage is None or stage.is_first
        last = stage is None or stage.is_last
        # --offload cpu: the trainer's held host gradient sums (Trainer; a pipeline's: Pipeline.host_sums)
        sums = par.host_grad_sums(module, a.offload) if row["microbatches"] > 1 else None

        def forward():
            """One micro-batch: ids on the first stage, else a received state ``[M, 1, T, D]``; the summed NLL on
            the last stage, else the state it sends (kept until its backward, as the schedule keeps it)."""
            if first:
                x = torch.randint(0, cfg.vocab_size, (1, T), device=device)
            else:
                x = torch.randn(sources_after(cfg, stage.start), 1, T, D, dtype=torch.bfloat16, device=device)
                x.requires_grad_(True)
            labels = torch.randint(0, cfg.vocab_size, (1, T), device=device) if last else None
            return module.loss(x, labels) if stage is None else stage(x, labels=labels)

        def backward(out):
            """The loss's gradient on the last stage, else a received gradient of the sent state."""
            if last:
                (out / T).backward()
            else:
                out.backward(torch.randn_like(out))

        def sync():
            if cuda:
                torch.cuda.synchronize()

        with LoopbackExperts.installed():
            outs = []
            for i in range(inflight):  # 1F1B warm-up: the in-flight forwards
                progress["phase"] = progress["step"] = f"forward {i}"
                outs.append(forward())
            for i, out in enumerate(outs):
                progress["phase"] = progress["step"] = f"backward {i}"
                backward(out)
                if sums is not None:  # a micro-batch before the step's last: its host gradients taken out of .grad
                    sums.take()
            del outs
            sync()
            progress["phase"] = progress["step"] = "timed"
            if memory_history and cuda:  # the timed micro-batch without the recording's host cost
                torch.cuda.memory._record_memory_history(enabled=None)
            t0 = time.perf_counter()  # one more micro-batch, timed alone (the steady state's forward + backward)
            with _profiled(profile and cuda) as prof:
                backward(forward())
                if sums is not None:  # a later micro-batch of the step: FSDP2's fast copy, then the host add
                    sums.take()
                sync()
            ms = (time.perf_counter() - t0) * 1e3
            if sums is not None:  # the step's gradients back in .grad (the last micro-batch's add not timed)
                sums.give_back()
            progress["phase"] = progress["step"] = "optimizer"
            t0 = time.perf_counter()
            masters.grads_to_masters()
            step_optimizer(optimizer, a, 1, par.rank)
            optimizer.zero_grad(set_to_none=True)
            masters.to_model()
            sync()
            optimizer_s = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() if cuda else None
        held = {"params": _local_bytes(module.parameters()), "optimizer": _local_bytes(_states(optimizer))}
    mem = row["memory"]
    return {
        "layout": L,
        "policy": row["policy"],
        "command": row["command"],
        "stage": s,
        "stage_layers": row["stages"][s],
        "tokens_per_microbatch": T,
        "microbatches_in_flight": inflight,
        "experts_per_rank": load_config(preset).num_experts // L["ep"],
        "rows_per_expert": row["rows_per_expert"],
        "rank_bytes": held,
        "predicted": {
            **{k: mem[k] for k in ("params", "grads", "optimizer", "gathered", "activations")},
            "total": mem["total"],
            "compute_ms_per_microbatch": row["time"]["stage_compute_per_microbatch"][s] * 1e3,
            # the timed micro-batch adds its gradient to the in-flight ones' (a later micro-batch of the step)
            "offload_ms_per_microbatch": row["time"]["offload_copy_per_microbatch"] * 1e3
            + row["time"].get("offload_grad_accumulate", 0.0) / max(1, row["microbatches"] - 1) * 1e3,
            "optimizer_s": row["time"]["optimizer"],
        },
        "measured": {"peak_bytes": peak, "ms_per_microbatch": ms, "optimizer_s": optimizer_s},
        **({"profile": profile_tables(prof)} if prof is not None else {}),
        "peak_over_predicted": peak / mem["total"] if peak else None,
        "cluster": {
            "gpus": L["world"],
            "tokens_per_s_per_gpu": row["tokens_per_s_per_gpu"],
            "tflops_per_gpu": row["tflops_per_gpu"],
            "mfu": row["mfu"],
        },
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="k3.1-pro")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--runs", nargs="+", choices=["full", "lora"], default=["full", "lora"])
    ap.add_argument("--clusters", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    ap.add_argument("--lora-gpus", type=int, default=64)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--gpu-memory", type=float, help="GB per GPU (default: 80 on a card under 100 GiB, else 141)")
    ap.add_argument(
        "--host-memory",
        type=float,
        help="GB of host memory the rank may hold (offloaded states; default: 90%% of this machine's available "
        "memory, so that a layout the machine cannot hold is not chosen)",
    )
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--plan-only", action="store_true", help="print the chosen layouts, materialise nothing")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="run the timed micro-batch under torch.profiler (CUDA) and add its top operators to each run's result",
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.gpu_memory is None:  # the planner's card: an 80 GB H100 or a 141 GB H200
        small = args.device == "cuda" and torch.cuda.get_device_properties(0).total_memory < 100 * 2**30
        args.gpu_memory = 80.0 if small else 141.0
    if args.host_memory is None:
        args.host_memory = 0.9 * available_host_gb()
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "date": time.strftime("%F")}
    report["runs"] = {}
    for run in args.runs:
        lora = args.lora_rank if run == "lora" else None
        row = None
        for gpus in [args.lora_gpus] if lora else args.clusters:
            row = choose(args.preset, gpus, args.seq_len, lora, args.gpu_memory, args.host_memory)
            if row is not None:
                break
        if row is None:
            report["runs"][run] = {"status": "no layout fits"}
            print(f"{run}: no layout fits", flush=True)
            continue
        L = row["layout"]
        print(f"{run}: {L['world']} GPUs, pp{L['pp']} dp{L['dp']} cp{L['cp']} ep{L['ep']}, {row['policy']}", flush=True)
        if args.plan_only:
            report["runs"][run] = {"status": "planned", "row": row}
            continue
        progress: dict = {}
        cuda = args.device == "cuda"
        try:
            res = rehearse(
                args.preset, row, args.device, lora, progress=progress, memory_history=cuda, profile=args.profile
            )
            res["status"] = "ok"
        except torch.OutOfMemoryError as e:
            res = {"status": "oom", "peak_bytes": torch.cuda.max_memory_allocated(), "command": row["command"]}
            res |= {"progress": progress, "predicted_total": row["memory"]["total"], "error": str(e).split("\n")[0]}
            res["live_by_place"] = live_by_place(torch.cuda.memory._snapshot())  # what held the card when it failed
        finally:
            if args.device == "cuda":
                torch.cuda.memory._record_memory_history(enabled=None)
        report["runs"][run] = res
        print(json.dumps(res), flush=True)
    if args.out:
        from kimi.checkpoint import write_atomic

        write_atomic(args.out, json.dumps(report, indent=1).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
