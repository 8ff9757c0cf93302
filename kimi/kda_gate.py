"""The saturation bounds of the KDA decay gate, shared by both paths (plain floats: no framework).

The gate (docs/spec.md section 2.2 step 5) is ``g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias))`` with a lower bound
``lb`` (K3) or ``g = -exp(A_log[h]) * softplus(f + dt_bias)`` without (Kimi-Linear). Public sources leave two limits
open (docs/spec.md section 9, "Gate saturation"); both paths take them from here, so the JAX reference, the torch twin
and the GPU preparation kernels (``kernels_torch.ops.kda_prep``, the cuDNN op's ``a_log``) saturate at the same place:

* :data:`A_LOG_MAX` caps the per-head rate ``exp(A_log)`` at ``exp(64) = 6.2e27``: finite in fp32 (which overflows
  past ``exp(88.7)``) with room for the gradient ``|lb| / 4 * rate``. Past it the lower-bound gate is a step function
  of ``f + dt_bias`` in any float format, so the cap changes no value a float could tell apart. Trained checkpoints
  have ``A_log`` near ``log(1..16)``. Without the cap, ``inf * 0`` is NaN in the value (at ``f + dt_bias = 0``) and in
  the gradients (``sigmoid' = 0`` at saturation).
* :data:`G_MIN` floors the softplus form: ``exp(-1000)`` is exactly 0 in fp32 and fp64 (fp64 underflows below -745),
  so no decay changes, and ``g`` stays finite, which the chunk form's cumulative sums need (a ``-inf`` or ``-1e30``
  there gives NaN in ``G_i - G_j``).
"""

from __future__ import annotations

__all__ = ["A_LOG_MAX", "G_MIN"]

A_LOG_MAX = 64.0
G_MIN = -1000.0
