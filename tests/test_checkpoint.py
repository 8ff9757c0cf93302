"""Checkpoint I/O: exact round trips (single file and sharded), laziness, every refusal, storage variants
(cases 7 and 17), the indexer bias default (spec 9) and atomic writes."""

from __future__ import annotations

import json
import os
import re
import struct

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import kimi.checkpoint as ckpt
from kimi.checkpoint import (
    INDEX_NAME,
    SINGLE_NAME,
    CheckpointError,
    CheckpointReader,
    load_params,
    pad_A_log,
    save_params,
    slice_A_log,
    to_stored,
    write_checkpoint,
)
from kimi.config import KimiConfig, load_config
from kimi.layout import layer_of, param_layout, stored_layout
from kimi.mxfp4 import dequantize_mxfp4, quantize_mxfp4

SHARD_RE = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


def random_params(cfg: KimiConfig, seed: int) -> dict[str, torch.Tensor]:
    """Fresh seeded random canonical params (never zeros); experts MXFP4-representable so a save is exact."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for s in param_layout(cfg):
        dt = getattr(torch, s.dtype)
        t = torch.randn(s.shape, generator=g, dtype=torch.float32) * 0.5 + 0.1
        if ".experts." in s.name and cfg.quant_method == "mxfp4":
            t = dequantize_mxfp4(*quantize_mxfp4(t), dtype=dt)
        out[s.name] = t.to(dt)
    return out


def kimi_linear_cfg() -> KimiConfig:
    return load_config("tiny").replace(
        architecture="KimiLinearForCausalLM",
        key_prefix="",
        dsa_layers=(),
        attn_res_block_size=None,
        quant_method=None,
        routed_expert_hidden_size=None,
        q_lora_rank=None,
        gate_lower_bound=None,
        use_full_rank_gate=False,
    )


def write_raw(path, stored: dict[str, torch.Tensor], cfg: KimiConfig) -> None:
    """Write a (possibly invalid) checkpoint with plain safetensors, bypassing write_checkpoint's validation."""
    os.makedirs(path, exist_ok=True)
    save_file({cfg.key_prefix + k: v.contiguous() for k, v in stored.items()}, os.path.join(path, SINGLE_NAME))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_dict(), f)


@pytest.fixture(scope="module")
def cfg() -> KimiConfig:
    return load_config("tiny")


@pytest.fixture(scope="module")
def params(cfg) -> dict[str, torch.Tensor]:
    return random_params(cfg, seed=1234)


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory, cfg, params):
    d = tmp_path_factory.mktemp("sharded")
    save_params(d, params, cfg, max_shard_bytes=150_000)
    return d


# ---------------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("max_shard_bytes", [150_000, 10**9], ids=["sharded", "single"])
def test_round_trip_identical_bytes(tmp_path, cfg, params, max_shard_bytes):
    save_params(tmp_path, params, cfg, max_shard_bytes=max_shard_bytes)
    files = sorted(os.listdir(tmp_path))
    shards = [f for f in files if f.endswith(".safetensors")]
    if max_shard_bytes == 10**9:
        assert shards == [SINGLE_NAME]
    else:
        assert len(shards) > 2 and all(SHARD_RE.match(f) for f in shards)
        assert {int(SHARD_RE.match(f).group(2)) for f in shards} == {len(shards)}
    assert not [f for f in files if f.startswith(".")], "no temporary files left"
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    stored = to_stored(params, cfg)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in stored.values())
    assert set(index["weight_map"]) == {cfg.key_prefix + k for k in stored}
    # On disk: prefixed keys, readable by plain safetensors, 8-byte aligned header, exact stored bytes.
    for f in shards:
        raw = (tmp_path / f).read_bytes()
        assert struct.unpack("<Q", raw[:8])[0] % 8 == 0
        disk = load_file(tmp_path / f)
        assert disk and all(k.startswith("language_model.") for k in disk)
        for k, t in disk.items():
            assert index["weight_map"][k] == f
            assert _same(t, stored[k.removeprefix("language_model.")]), k
    loaded = load_params(tmp_path)
    assert list(loaded) == list(params)
    for k in params:
        assert _same(loaded[k], params[k]), k
    assert CheckpointReader(tmp_path).config == cfg


def test_reader_metadata_without_reading(sharded_dir, cfg):
    r = CheckpointReader(sharded_dir)
    assert sorted(r.keys()) == sorted(s.name for s in stored_layout(cfg))
    for s in stored_layout(cfg):
        assert r.shape(s.name) == s.shape and r.dtype(s.name) == s.dtype
    assert r.read_names == set() and not r._handles
    with pytest.raises(CheckpointError, match="no tensor named"):
        r.get("model.layers.0.nope")


def test_lazy_layer_read(sharded_dir, cfg, params):
    r = CheckpointReader(sharded_dir)
    got = load_params(r, layers=[2])
    assert {layer_of(n) for n in r.read_names} == {None, 2}
    assert set(got) == {s.name for s in param_layout(cfg, [2])}
    needed = {r.file_of(n) for n in r.read_names}
    assert set(r._handles) == needed and len(needed) < len(r.files), "only the shards holding layer 2 are opened"
    for k, t in got.items():
        assert _same(t, params[k]), k


def test_truncated_config_reads_prefix(sharded_dir, cfg, params):
    small = cfg.truncated(4)
    r = CheckpointReader(sharded_dir)
    got = load_params(r, config=small)
    assert set(got) == {s.name for s in param_layout(small)}
    assert {layer_of(n) for n in r.read_names} == {None, 0, 1, 2, 3}
    assert all(_same(t, params[k]) for k, t in got.items())


def test_kimi_linear_round_trip(tmp_path):
    kl = kimi_linear_cfg()
    p = random_params(kl, seed=7)
    save_params(tmp_path, p, kl)
    r = CheckpointReader(tmp_path)
    assert r.config.is_kimi_linear and r.config.key_prefix == ""
    weight_map = json.loads((tmp_path / INDEX_NAME).read_text())["weight_map"]
    assert all(not k.startswith("language_model.") for k in weight_map)
    name = f"model.layers.{kl.kda_layers[0]}.self_attn.A_log"
    assert r.shape(name) == (1, 1, kl.kda_num_heads, 1)
    got = load_params(r)
    assert got[name].shape == (kl.kda_num_heads,)
    assert all(_same(got[k], p[k]) for k in p)


def test_raw_config_json_round_trips(tmp_path, cfg, params):
    raw = json.loads(json.dumps(cfg.to_dict()))
    raw["some_unmodelled_key"] = {"kept": True}
    c = KimiConfig.from_dict(raw)
    save_params(tmp_path / "a", params, c)
    assert json.loads((tmp_path / "a" / "config.json").read_text()) == raw
    # a truncated copy still carries the old raw, which no longer describes it: to_dict() is written instead
    small = c.truncated(2)
    save_params(tmp_path / "b", {k: v for k, v in params.items() if layer_of(k) in (None, 0, 1)}, small)
    assert CheckpointReader(tmp_path / "b").config.num_hidden_layers == 2


# ---------------------------------------------------------------------------------------------- refusals


def _broken(tmp_path, cfg, params, mutate):
    stored = to_stored(params, cfg)
    mutate(stored)
    write_raw(tmp_path, stored, cfg)
    return tmp_path


L2 = "model.layers.2.self_attn.q_proj.weight"
L2_CONV = "model.layers.2.self_attn.k_conv1d.weight"
L2_DT = "model.layers.2.self_attn.dt_bias"


def test_missing_tensor(tmp_path, cfg, params):
    d = _broken(tmp_path, cfg, params, lambda s: s.pop(L2))
    with pytest.raises(CheckpointError, match=rf"missing: {re.escape(L2)} \(expected \[64, 96\] bfloat16\)"):
        load_params(d)


def test_unexpected_tensor_in_layer_and_global(tmp_path, cfg, params):
    def mutate(s):
        s["model.layers.2.self_attn.bogus.weight"] = torch.ones(3)
        s["model.extra_head.weight"] = torch.ones(2, 2, dtype=torch.bfloat16)

    d = _broken(tmp_path, cfg, params, mutate)
    with pytest.raises(CheckpointError) as e:
        load_params(d, layers=[2])
    msg = str(e.value)
    assert "unexpected: model.layers.2.self_attn.bogus.weight (found [3] float32)" in msg
    assert "unexpected: model.extra_head.weight (found [2, 2] bfloat16)" in msg
    assert len(e.value.problems) == 2


def test_misshaped_tensor(tmp_path, cfg, params):
    d = _broken(tmp_path, cfg, params, lambda s: s.__setitem__(L2, torch.ones(64, 95, dtype=torch.bfloat16)))
    with pytest.raises(
        CheckpointError,
        match=r"wrong shape: .*q_proj.weight \(expected \[64, 96\] bfloat16, "
        r"found \[64, 95\] bfloat16\)",
    ):
        load_params(d)


def test_wrong_dtype(tmp_path, cfg, params):
    d = _broken(tmp_path, cfg, params, lambda s: s.__setitem__(L2_DT, s[L2_DT].to(torch.bfloat16)))
    want = r"wrong dtype: .*dt_bias \(expected \[64\] float32, found \[64\] bfloat16\)"
    with pytest.raises(CheckpointError, match=want):
        load_params(d)


def test_several_problems_in_one_error(tmp_path, cfg, params):
    expert = "model.layers.5.block_sparse_moe.experts.3.w2.weight_scale"

    def mutate(s):
        s.pop(L2)
        s["model.layers.2.mystery"] = torch.ones(1)
        s[L2_DT] = s[L2_DT].double()
        s[expert] = torch.ones(64, 2, dtype=torch.uint8)
        s["model.norm.weight"] = torch.ones(95)

    d = _broken(tmp_path, cfg, params, mutate)
    with pytest.raises(CheckpointError) as e:
        load_params(d)
    msg = str(e.value)
    for n in (L2, "model.layers.2.mystery", L2_DT, expert, "model.norm.weight"):
        assert n in msg
    assert "wrong shape and dtype: model.norm.weight (expected [96] bfloat16, found [95] float32)" in msg
    assert len(e.value.problems) == 5 and "5 problem(s)" in msg
    # the problems live in layers 2, 5 and the globals: layer 4 alone still fails on the global one only
    with pytest.raises(CheckpointError) as e4:
        load_params(d, layers=[4])
    assert len(e4.value.problems) == 1 and "model.norm.weight" in e4.value.problems[0]


def test_problem_in_unrequested_layer_is_not_read(tmp_path, cfg, params):
    d = _broken(tmp_path, cfg, params, lambda s: s.pop("model.layers.6.self_attn.o_proj.weight"))
    got = load_params(d, layers=[0, 1, 2])
    assert all(_same(got[k], params[k]) for k in got)
    with pytest.raises(CheckpointError, match="model.layers.6.self_attn.o_proj.weight"):
        load_params(d)


def test_stray_layer_beyond_config(tmp_path, cfg, params):
    d = _broken(tmp_path, cfg, params, lambda s: s.__setitem__("model.layers.9.input_layernorm.weight", torch.ones(2)))
    with pytest.raises(CheckpointError, match="unexpected: model.layers.9.input_layernorm.weight"):
        load_params(d)
    # also when the caller passes the config (as every load_model does): config.json and tensors disagree
    with pytest.raises(CheckpointError, match="unexpected: model.layers.9.input_layernorm.weight"):
        load_params(d, KimiConfig.from_json(d / "config.json"))
    # and with a truncated config: the checkpoint itself is inconsistent (a healthy checkpoint's later layers are
    # left unread by a truncated config: test_truncated_config_reads_a_prefix)
    with pytest.raises(CheckpointError, match="unexpected: model.layers.9.input_layernorm.weight"):
        load_params(d, cfg.truncated(2), layers=2)


def test_truncated_config_reads_a_prefix(tmp_path, cfg, params):
    d = _broken(tmp_path, cfg, params, lambda s: None)
    got = load_params(d, cfg.truncated(2), layers=2)
    assert {layer_of(n) for n in got} - {None} == {0, 1}


def test_unprefixed_key(tmp_path, cfg, params):
    d = _broken(tmp_path, cfg, params, lambda s: None)
    stored = load_file(d / SINGLE_NAME)
    stored["model.norm.weight"] = torch.ones(96, dtype=torch.bfloat16)  # K3 key without language_model.
    stored["vision_tower.blocks.0.weight"] = torch.ones(4)  # vision keys are ignored
    save_file(stored, d / SINGLE_NAME)
    r = CheckpointReader(d)
    assert "vision_tower.blocks.0.weight" not in r.keys() and r.unprefixed == ["model.norm.weight"]
    with pytest.raises(CheckpointError) as e:
        load_params(r)
    assert e.value.problems == ["unexpected: model.norm.weight (key lacks the prefix 'language_model.')"]


def test_missing_shard(tmp_path, cfg, params):
    save_params(tmp_path, params, cfg, max_shard_bytes=150_000)
    last = sorted(f for f in os.listdir(tmp_path) if SHARD_RE.match(f))[-1]
    os.remove(tmp_path / last)
    r = CheckpointReader(tmp_path)  # a partial download still opens
    assert r.missing_files == [last]
    with pytest.raises(CheckpointError, match=rf"missing: \['{last}'\]|missing: .*{last}"):
        load_params(r)
    got = load_params(r, layers=[0])  # layer 0 and the globals live in the first shards
    assert all(_same(got[k], params[k]) for k in got)
    lost = next(n for n in r.keys() if r.file_of(n) == last)
    with pytest.raises(CheckpointError, match=f"shard '{last}'.*missing"):
        r.get(lost)


def test_not_a_checkpoint_dir(tmp_path, cfg):
    with pytest.raises(CheckpointError, match="no such directory"):
        CheckpointReader(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no config.json"):
        CheckpointReader(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    with pytest.raises(CheckpointError, match="neither"):
        CheckpointReader(tmp_path)
    (tmp_path / INDEX_NAME).write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="weight_map"):
        CheckpointReader(tmp_path)
    (tmp_path / INDEX_NAME).unlink()
    (tmp_path / SINGLE_NAME).write_bytes(b"\xff" * 4)
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        CheckpointReader(tmp_path)


def test_write_refuses_bad_dict_and_writes_nothing(tmp_path, cfg, params):
    stored = to_stored(params, cfg)
    stored.pop(L2)
    stored[L2_DT] = stored[L2_DT].half()
    stored["model.layers.1.surprise"] = torch.ones(1)
    with pytest.raises(CheckpointError) as e:
        write_checkpoint(tmp_path / "out", stored, cfg)
    assert len(e.value.problems) == 3
    assert not (tmp_path / "out").exists()


def test_to_stored_refuses_bad_params(cfg, params):
    bad = dict(params)
    bad.pop("model.layers.3.self_attn.kv_b_proj.weight")
    bad["model.layers.1.block_sparse_moe.experts.0.w1.weight"] = torch.ones(32, 63, dtype=torch.bfloat16)
    with pytest.raises(CheckpointError) as e:
        to_stored(bad, cfg)
    assert len(e.value.problems) == 2


# ---------------------------------------------------------------------------------------------- variants


def test_conv_weight_2d_variant(tmp_path, cfg, params):
    d = _broken(tmp_path, cfg, params, lambda s: s.__setitem__(L2_CONV, s[L2_CONV].reshape(64, 4)))
    got = load_params(d)
    assert got[L2_CONV].shape == (64, 1, 4) and _same(got[L2_CONV], params[L2_CONV])


def test_a_log_padding_sliced_and_repadded(tmp_path, cfg, params):
    # case 7: K3 stores a_log_storage entries (96 -> 128; tiny: 4 -> 128), H used; save re-pads with zeros.
    name = "model.layers.2.self_attn.A_log"
    H, P = cfg.kda_num_heads, cfg.a_log_storage
    assert P > H
    stored = to_stored(params, cfg)
    assert stored[name].shape == (P,) and torch.equal(stored[name][:H], params[name])
    assert torch.equal(stored[name][H:], torch.zeros(P - H))
    write_raw(tmp_path / "ok", stored, cfg)
    got = load_params(tmp_path / "ok")
    assert got[name].shape == (H,) and _same(got[name], params[name])
    stored[name] = stored[name].clone()
    stored[name][H + 1] = 7.0  # non-zero padding means a wrong layout: refused, naming the tensor
    write_raw(tmp_path / "bad", stored, cfg)
    with pytest.raises(CheckpointError, match=r"A_log.*non-zero entries past the 4 active heads"):
        load_params(tmp_path / "bad")


def test_iter_arrays_reads_experts_ahead_in_order(tmp_path, cfg, params, monkeypatch):
    """The MXFP4 experts decoded ahead by threads come out in param_layout order with the one-at-a-time bytes, with
    at most the look-ahead window in flight; a consumer that stops early leaves no read running."""
    import threading

    write_checkpoint(tmp_path / "ck", to_stored(params, cfg), cfg)
    names = [s.name for s in param_layout(cfg)]
    experts = [n for n in names if ".experts." in n]
    assert len(experts) > 4 and cfg.quant_method == "mxfp4"
    monkeypatch.setattr(ckpt.os, "cpu_count", lambda: 2)  # 2 workers, a window of 4 experts
    inflight, started = [0], []
    lock = threading.Lock()
    real = ckpt._read_canonical

    def counted(reader, c, spec):
        with lock:
            inflight[0] += 1
            started.append(spec.name)
        try:
            return real(reader, c, spec)
        finally:
            with lock:
                inflight[0] -= 1

    monkeypatch.setattr(ckpt, "_read_canonical", counted)
    got, ahead = [], 0
    for n, a in ckpt.iter_arrays(tmp_path / "ck"):
        got.append((n, a))
        with lock:  # experts whose read began before this tensor was yielded, beyond it: the window
            later = experts[experts.index(n) + 1 :] if n in experts else []
            ahead = max(ahead, len(set(started) & set(later)))
    assert [n for n, _ in got] == names
    reader = ckpt.CheckpointReader(tmp_path / "ck")
    for (n, a), spec in zip(got, param_layout(cfg)):  # one at a time, in the main thread
        want = real(reader, cfg, spec)
        assert a.dtype == want.dtype and np.array_equal(a.view(np.uint8), want.view(np.uint8)), n
    assert 1 <= ahead <= 4  # read ahead, within 2 x workers
    stream = ckpt.iter_arrays(tmp_path / "ck")
    first = next(n for n, _ in stream if ".experts." in n)
    stream.close()  # stops early: the pool is shut down, pending reads cancelled
    assert first == experts[0] and inflight[0] == 0


def test_truncated_shard_and_nan_scale_are_named(tmp_path, cfg, params):
    stored = to_stored(params, cfg)
    scale = "model.layers.1.block_sparse_moe.experts.3.w2.weight_scale"
    stored[scale] = stored[scale].clone()
    stored[scale][0, 0] = 255  # E8M0 NaN
    write_raw(tmp_path / "nan", stored, cfg)
    with pytest.raises(CheckpointError, match=r"experts\.3\.w2\.weight_scale.*255"):
        load_params(tmp_path / "nan")
    write_checkpoint(tmp_path / "trunc", to_stored(params, cfg), cfg)
    shard = sorted((tmp_path / "trunc").glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="cannot read tensor"):
        load_params(tmp_path / "trunc")


def _header_bytes(header: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", r"not a safetensors file \(shorter than the 8-byte header length\)"),
        (b"\x07" * 7, r"not a safetensors file \(shorter than the 8-byte header length\)"),
        (struct.pack("<Q", 10**6) + b"{}", r"not a safetensors file \(its header length points past the end"),
        (_header_bytes(b"{abc}"), r"not a safetensors file \(bad header\).*JSON"),
        (_header_bytes(b"[1, 2]"), r"not a safetensors file \(bad header\)"),
        (_header_bytes(b'{"model.norm.weight": 3}'), r"not a safetensors file \(bad header\)"),
        (_header_bytes(b"\xff\xfe{}"), r"not a safetensors file \(bad header\).*UTF-8"),
        (
            _header_bytes(b'{"model.norm.weight": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 1]}}') + b"\0",
            r"not a safetensors file \(bad header\).*Q9",
        ),
    ],
    ids=[
        "empty",
        "7-bytes",
        "length-past-end",
        "bad-json",
        "not-an-object",
        "entry-not-an-object",
        "bad-utf8",
        "dtype",
    ],
)
def test_damaged_header_is_named(tmp_path, cfg, data, message):
    """Every kind of damaged header (read through safetensors.safe_open) gives a CheckpointError naming the file and
    the damage in this module's words, plus safetensors' own reason; never safetensors' raw error. Mutations killed:
    dropping the translation table (every message becomes the generic one) or the ``except`` (a raw SafetensorError)."""
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    (tmp_path / SINGLE_NAME).write_bytes(data)
    with pytest.raises(CheckpointError, match=message) as e:
        CheckpointReader(tmp_path)
    assert str(tmp_path / SINGLE_NAME) in str(e.value) and "safetensors says:" in str(e.value)


def test_shard_longer_or_shorter_than_its_header_is_named(tmp_path, cfg, params):
    """A shard whose data does not cover exactly what its header lists (cut short, or with bytes appended) is named
    when its header is first read, before any tensor data."""
    for name, cut in (("short", lambda b: b[:-1]), ("long", lambda b: b + b"\0" * 8)):
        save_params(tmp_path / name, params, cfg, max_shard_bytes=150_000)
        shard = sorted((tmp_path / name).glob("model-*.safetensors"))[-1]
        shard.write_bytes(cut(shard.read_bytes()))
        r = CheckpointReader(tmp_path / name)  # the index alone: opening reads no shard
        lost = next(n for n in r.keys() if r.file_of(n) == shard.name)
        with pytest.raises(
            CheckpointError, match=rf"{re.escape(shard.name)}: cannot read tensor data: the file's length"
        ):
            r.shape(lost)
        assert not r.read_names


@pytest.mark.parametrize("preset", ["k3", "tiny", "tiny-linear"])
def test_slice_and_pad_A_log(preset):
    """Case 7 and 17: the stored A_log (K3 zero-padded to 128 with 96 used; Kimi-Linear [1, 1, H, 1]) <-> the
    canonical [H]; the one copy of these helpers, used by load_arrays and to_stored."""
    cfg = load_config(preset)
    i = cfg.kda_layers[0]
    H = cfg.kda_num_heads
    stored = next(s for s in stored_layout(cfg, [i]) if s.name.endswith("A_log"))
    canon = next(s for s in param_layout(cfg, [i]) if s.name.endswith("A_log"))
    assert canon.shape == (H,)
    a = np.log(np.random.default_rng(7).uniform(1, 16, H)).astype(np.float32)
    padded = pad_A_log(a, stored.shape)
    assert padded.shape == stored.shape and (padded.reshape(-1)[H:] == 0).all()
    np.testing.assert_array_equal(slice_A_log(padded, H), a)
    np.testing.assert_array_equal(slice_A_log(a.reshape(1, 1, H, 1), H), a)
    np.testing.assert_array_equal(slice_A_log(a, H), a)
    np.testing.assert_array_equal(pad_A_log(a, (1, 1, H, 1)), a.reshape(1, 1, H, 1))
    bad = pad_A_log(a, (H + 5,))
    bad[H + 2] = 1.0
    with pytest.raises(ValueError, match=rf"A_log: got 1 non-zero entries past the {H} active heads"):
        slice_A_log(bad, H)
    with pytest.raises(ValueError, match=r"A_log: got shape \[3\]" if H == 4 else "A_log: got shape"):
        slice_A_log(a[: H - 1], H)
    with pytest.raises(ValueError, match="A_log: got shape"):
        pad_A_log(a.reshape(1, H), (128,))
    with pytest.raises(ValueError, match="shape: got"):
        pad_A_log(a, (H - 1,))


@pytest.mark.parametrize("shape", ["1,1,H,1", "H"])
def test_a_log_alternative_shapes_in_k3(tmp_path, cfg, params, shape):
    name = "model.layers.4.self_attn.A_log"
    H = cfg.kda_num_heads
    d = _broken(
        tmp_path,
        cfg,
        params,
        lambda s: s.__setitem__(name, params[name].reshape((1, 1, H, 1) if shape == "1,1,H,1" else (H,)).clone()),
    )
    assert _same(load_params(d)[name], params[name])


def test_a_log_padded_in_kimi_linear(tmp_path):
    kl = kimi_linear_cfg()
    p = random_params(kl, seed=3)
    name = f"model.layers.{kl.kda_layers[1]}.self_attn.A_log"
    stored = to_stored(p, kl)
    assert stored[name].shape == (1, 1, kl.kda_num_heads, 1)
    stored[name] = torch.cat([p[name], torch.zeros(kl.a_log_storage - kl.kda_num_heads)])
    write_raw(tmp_path, stored, kl)
    assert _same(load_params(tmp_path)[name], p[name])


def test_a_log_bad_shape_refused(tmp_path, cfg, params):
    name = "model.layers.2.self_attn.A_log"
    d = _broken(tmp_path, cfg, params, lambda s: s.__setitem__(name, torch.zeros(5)))
    want = rf"wrong shape: .*A_log \(expected \[{cfg.a_log_storage}\] float32, found \[5\] float32\)"
    with pytest.raises(CheckpointError, match=want):
        load_params(d)


def test_missing_k_norm_bias_loads_zeros(tmp_path, cfg, params):
    dsa = cfg.dsa_layers[0]
    name = f"model.layers.{dsa}.self_attn.indexer.k_norm.bias"
    d = _broken(tmp_path, cfg, params, lambda s: s.pop(name))
    got = load_params(d)
    assert torch.equal(got[name], torch.zeros(cfg.index_head_dim, dtype=torch.bfloat16))
    assert got[name].dtype == torch.bfloat16
    other = f"model.layers.{cfg.dsa_layers[1]}.self_attn.indexer.k_norm.bias"
    assert _same(got[other], params[other])


# ---------------------------------------------------------------------------------------------- atomic writes


def _final_named(d) -> list[str]:
    return [f for f in os.listdir(d) if not f.startswith(".")]


@pytest.mark.parametrize("fail_at", [1, 40, 400], ids=["first-tensor", "second-shard", "late"])
def test_crash_mid_write_leaves_no_partial_file(tmp_path, cfg, params, monkeypatch, fail_at):
    real = ckpt._write_tensor_data
    calls = [0]

    def flaky(f, t):
        calls[0] += 1
        if calls[0] == fail_at:
            f.write(b"\x00" * 3)  # half a tensor, then the crash
            raise OSError("disk full (injected)")
        real(f, t)

    monkeypatch.setattr(ckpt, "_write_tensor_data", flaky)
    with pytest.raises(OSError, match="injected"):
        save_params(tmp_path, params, cfg, max_shard_bytes=150_000)
    assert _final_named(tmp_path) == []
    assert os.listdir(tmp_path) == [], "temporary files are removed"


def test_crash_keeps_previous_checkpoint(tmp_path, cfg, params, monkeypatch):
    save_params(tmp_path, params, cfg, max_shard_bytes=150_000)
    before = {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)}
    other = random_params(cfg, seed=99)
    monkeypatch.setattr(ckpt, "_write_tensor_data", lambda f, t: (_ for _ in ()).throw(OSError("injected")))
    with pytest.raises(OSError):
        save_params(tmp_path, other, cfg, max_shard_bytes=150_000)
    assert {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)} == before
    assert all(_same(t, params[k]) for k, t in load_params(tmp_path).items())


def test_crash_during_commit_leaves_no_index(tmp_path, cfg, params, monkeypatch):
    real = os.replace
    calls = [0]

    def flaky(a, b):
        calls[0] += 1
        if calls[0] == 3:
            raise OSError("power cut (injected)")
        real(a, b)

    monkeypatch.setattr(ckpt.os, "replace", flaky)
    with pytest.raises(OSError, match="injected"):
        save_params(tmp_path, params, cfg, max_shard_bytes=150_000)
    monkeypatch.setattr(ckpt.os, "replace", real)
    assert INDEX_NAME not in os.listdir(tmp_path)
    for f in _final_named(tmp_path):  # whatever has a final name is complete
        with safe_open(tmp_path / f, framework="pt") as h:
            for k in h.keys():
                h.get_tensor(k)


def test_overwrite_with_fewer_shards_removes_stale(tmp_path, cfg, params):
    save_params(tmp_path, params, cfg, max_shard_bytes=150_000)
    save_params(tmp_path, params, cfg)
    assert sorted(_final_named(tmp_path)) == ["config.json", SINGLE_NAME, INDEX_NAME]
    assert all(_same(t, params[k]) for k, t in load_params(tmp_path).items())


# ---------------------------------------------------------------------------------------------- atomic writes


def test_atomic_writes_refuse_a_target_that_is_not_a_regular_file(tmp_path, cfg, params):
    """A rename replaces whatever entry the target names: ``write_atomic`` onto a device (here a link to /dev/null,
    so the old behaviour replaced the link, never the device), a named pipe or a folder is refused with one error
    naming the path and what it is, and the entry is left as it was; a regular file and a link to one are written.
    ``write_checkpoint`` checks its final names the same way before writing anything."""
    import stat

    dev = tmp_path / "null"
    dev.symlink_to("/dev/null")
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    folder = tmp_path / "folder"
    folder.mkdir()
    broken = tmp_path / "broken"
    broken.symlink_to(tmp_path / "absent")
    for target, what in [(dev, "a character device"), (pipe, "a named pipe"), (folder, "a folder"),
                         (broken, "a broken symbolic link")]:  # fmt: skip
        before = os.lstat(target)
        with pytest.raises(FileExistsError, match=rf"^{re.escape(str(target))}: exists and is {what}, not a regular"):
            ckpt.write_atomic(target, b"data")
        after = os.lstat(target)
        assert (stat.S_IFMT(after.st_mode), after.st_ino) == (stat.S_IFMT(before.st_mode), before.st_ino), target
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "folder", "null", "pipe"]  # no temporary left
    (tmp_path / "file").write_bytes(b"old")
    (tmp_path / "link").symlink_to(tmp_path / "file")
    for name in ("file", "link", "new"):
        ckpt.write_atomic(tmp_path / name, b"new " + name.encode())
        assert (tmp_path / name).read_bytes() == b"new " + name.encode()
    out = tmp_path / "ckpt"
    out.mkdir()
    os.mkfifo(out / SINGLE_NAME)
    with pytest.raises(FileExistsError, match=rf"{SINGLE_NAME}: exists and is a named pipe"):
        save_params(out, params, cfg)
    assert [p.name for p in out.iterdir()] == [SINGLE_NAME] and stat.S_ISFIFO(os.lstat(out / SINGLE_NAME).st_mode)
