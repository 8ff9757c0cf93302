"""CPU checks of ``kernels_torch.kernel_choice``: resolution order, errors, the record of what ran, and the model-level
switch of ``load_model(..., sparse_kernel=..., kda_kernel=...)``."""

from __future__ import annotations

import pytest

from kernels_torch import kernel_choice
from kernels_torch.model import load_model


def test_resolve_order_and_errors(monkeypatch):
    monkeypatch.delenv("KIMI_KDA_KERNEL", raising=False)
    assert kernel_choice.resolve("kda") == "auto"
    monkeypatch.setenv("KIMI_KDA_KERNEL", "fla")
    assert kernel_choice.resolve("kda") == "fla"
    assert kernel_choice.resolve("kda", "cudnn") == "cudnn"  # an explicit choice beats the environment
    with pytest.raises(ValueError, match=r"kernel argument.*'triton'.*kda"):
        kernel_choice.resolve("kda", "triton")
    monkeypatch.setenv("KIMI_KDA_KERNEL", "fast")
    with pytest.raises(ValueError, match=r"\$KIMI_KDA_KERNEL.*'fast'"):
        kernel_choice.resolve("kda")
    with pytest.raises(ValueError, match="op"):
        kernel_choice.resolve("no_such_op")  # ('moe' is an op now: the grouped experts)


def test_record_and_reset():
    kernel_choice.reset_used()
    kernel_choice.record("kda", "cudnn")
    kernel_choice.record("kda", "cudnn")
    kernel_choice.record("sparse_mla_fwd", "triton")
    assert kernel_choice.used() == {"kda": {"cudnn": 2}, "sparse_mla_fwd": {"triton": 1}}
    kernel_choice.reset_used()
    assert kernel_choice.used() == {}


def test_load_model_sets_every_layer(tiny_ckpt):
    m = load_model(tiny_ckpt, backend="cudnn", sparse_kernel="triton", kda_kernel="fla")
    kda = [x for x in m.modules() if hasattr(x, "kda_kernel")]
    mla = [x for x in m.modules() if hasattr(x, "sparse_kernel")]
    assert kda and mla
    assert {x.kda_kernel for x in kda} == {"fla"} and {x.sparse_kernel for x in mla} == {"triton"}
    assert {x.kda_kernel for x in load_model(tiny_ckpt).modules() if hasattr(x, "kda_kernel")} == {None}
    with pytest.raises(ValueError, match="flashmla"):
        load_model(tiny_ckpt, sparse_kernel="flashmla")
    m = load_model(tiny_ckpt, backend="cudnn", kda_prep="in_kernel")
    assert {x.kda_prep for x in m.modules() if hasattr(x, "kda_kernel")} == {"in_kernel"}
    with pytest.raises(ValueError, match="fused"):  # refused before the checkpoint is read, whatever the backend
        load_model(tiny_ckpt, kda_prep="fused")
    m = load_model(tiny_ckpt, backend="cudnn", kda_pieces="cudnn")
    assert {x.kda_pieces for x in m.modules() if hasattr(x, "kda_kernel")} == {"cudnn"}
    with pytest.raises(ValueError, match="kda_pieces"):
        load_model(tiny_ckpt, kda_pieces="two")


@pytest.mark.parametrize("var", sorted(kernel_choice.ENV_VARS.values()))
def test_bad_environment_fails_when_a_cudnn_model_is_built(monkeypatch, var):
    """A misspelt $KIMI_* kernel variable is refused where the cudnn model is built (naming the variable and the
    value), not at the first call of the kernel (never, on a CPU); the dense-mask backends do not read them."""
    from kernels_torch.model import KimiK3Model
    from kimi.config import load_config

    monkeypatch.setenv(var, "bogus")
    with pytest.raises(ValueError, match=rf"\${var}: got 'bogus'"):
        KimiK3Model(load_config("tiny"), backend="cudnn")
    KimiK3Model(load_config("tiny"), backend="eager")


def test_bad_environment_fails_before_load_model_reads_the_checkpoint(monkeypatch, tmp_path):
    """load_model builds the model after reading every weight: the $KIMI_* check must come before the read (no
    checkpoint here: the environment's error, not the missing folder's, must be the one raised)."""
    monkeypatch.setenv("KIMI_GLU_KERNEL", "bogus")
    with pytest.raises(ValueError, match=r"\$KIMI_GLU_KERNEL: got 'bogus'"):
        load_model(tmp_path / "absent", backend="cudnn")
