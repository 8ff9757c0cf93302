"""``kimi train``: full fine-tuning (or LoRA) of the torch twin on packed real text, resumable exactly, saved on
Ctrl-C.

Modelled on nanochat's ``scripts/base_train.py`` (one loop read top to bottom; the schedule a pure function of the
step; one record per step) and torchtitan's ``Trainer`` (one ``Stateful`` object owning the components; the job
config a dataclass from which the command line is derived; named ``Stateful``s saved by
``torch.distributed.checkpoint`` into ``step-N/`` folders, valid only with their ``.metadata``).

Python API: ``train(TrainArgs(...)) -> TrainResult`` (the CLI is a thin wrapper), or ``Trainer(TrainArgs(...))``
for its parts (``evaluate()``, ``train_step()``, ``run()``). The package, one component a module:

* :mod:`~kimi_tools.train.args`: :class:`TrainArgs` (each field a flag, its help in the field's metadata),
  ``resolve`` (defaults and checks), the fingerprint of the settings that change the numbers;
* :mod:`~kimi_tools.train.stages`: the objective (:class:`LMStage`; the registry :data:`STAGES`, where the
  distillation stages of ``kimi_tools.distill`` are registered);
* :mod:`~kimi_tools.train.weights`: model build, the model-conversion hook (``CONVERTERS``), trainable set, fp32
  masters, AdamW, gradient clipping, activation recomputation;
* :mod:`~kimi_tools.train.schedule`: :func:`lr_multiplier` (warm-up + cosine) through ``LambdaLR``;
* :mod:`~kimi_tools.train.checkpoint`: ``step-N/`` resume states, the run folder, the final export;
* :mod:`~kimi_tools.train.metrics`: ``metrics.jsonl`` and ``loss.png``;
* :mod:`~kimi_tools.train.interrupt`: SIGINT / SIGTERM handling;
* :mod:`~kimi_tools.train.trainer`: :class:`Trainer` and :func:`train`; :mod:`~kimi_tools.train.cli`: ``kimi train``.

What a run does, in order:

1. **Check everything first** (arguments, data, model source, LoRA options, parallel layout, the output folder): a
   bad input raises ``ValueError`` with one line naming the field, before anything is written.
2. **Model**: ``--checkpoint DIR`` (read lazily, ``--layers N`` keeps the first N layers) or ``--preset NAME``
   (random init, :func:`kimi.init.init_params`, ``--seed``), on ``--backend`` in ``--dtype``. Parameters stay in
   the checkpoint's dtypes (``A_log``, ``dt_bias``, conv weights, ``o_norm`` in fp32). In bf16 the optimizer
   works on **fp32 master copies** of the trainable parameters (gradients are copied up, the update is rounded
   down into the model after every step), so AdamW state and updates are fp32; ``--optimizer adamw-bf16`` keeps no
   masters: torchao's AdamW steps the bf16 weights with bf16 moments and stochastic rounding.
3. **Trainable parameters** = those the stage allows (``lm``: everything except the DSA indexer, which the hard
   top-k gives no LM-loss gradient, and the router's ``e_score_correction_bias``, which aux-loss-free balancing
   updates by a rule, not by gradient: DeepSeek-V3 section 2.1.2), minus ``--freeze`` glob patterns
   (``fnmatch`` on the canonical parameter name), and with LoRA only the adapters. Frozen parameters have
   ``requires_grad=False`` and are not in the optimizer.
4. **Data** (:mod:`kimi_tools.data`): documents packed into rows of ``--seq-len`` tokens with ``cu_seqlens``;
   ``--micro-batch-tokens`` per forward on each rank (whole rows), ``--batch-tokens`` per optimizer step over all
   ranks (gradient accumulation; default one micro-batch per data-parallel group and per pipeline stage the schedule
   needs, so a one-process command runs under any layout). The loss is the mean cross-entropy over the step's target tokens (micro-batches weighted by their
   target count, so accumulation equals one big batch). Eval: ``--eval-data`` or the last ``--eval-fraction`` of
   the tokens held out; up to ``--eval-tokens`` tokens, in eval mode (no dropout), at step 0, every
   ``--eval-every`` steps and at the end.
5. **Step**: AdamW (``torch.optim``, or torchao's under ``--optimizer adamw-bf16``; weight decay on matrices only, never on norms, biases, ``A_log``,
   ``dt_bias``), warm-up + cosine (:func:`lr_multiplier`: step k applies ``lr * lr_multiplier(k - 1)``), gradient
   clipping at ``--grad-clip`` (the record holds the norm before clipping), per-layer activation recomputation with
   ``--recompute`` (``--recompute-mode layer | mlp | attn``, ``--recompute-layers`` by layer kind) and activation
   offload to host memory (``--offload-activations all | attn | mlp``: :mod:`~kernels_torch.activation_memory`).
6. **Output folder** ``--out``: ``run.json`` (resolved arguments, model config, fingerprint); ``metrics.jsonl``
   (one record per step, keys :data:`RECORD_KEYS` plus the stage's metrics; a ``step`` 0 record holds the first
   eval loss); ``step-N/`` resume states (trainable weights as their masters, AdamW, schedule, data position, RNG,
   step and tokens seen; the latest ``--keep``), saved every ``--save-every`` (default every 10 minutes; ``N``
   steps; 0: only at the end), at ``--stop-after`` and at the end; and, **once the run reaches ``--steps``**, the
   model in the HF safetensors layout (``kernels_torch.model.save_model``: ``config.json``, shards, index; loadable
   by ``kimi compare --checkpoint``, ``kimi logits`` and ``reference_jax.model.load_model``) or, with LoRA, the
   adapter in peft's two files (with the base checkpoint's fingerprint); ``loss.png``. An interrupted, stopped or
   diverged run has its resume state and no model. Routed experts of an MXFP4 checkpoint are re-quantised on
   export (the checkpoint format); the resume state keeps the exact weights.
7. **Resume** (``--resume``, same arguments): the fingerprint of the model config and of every argument that
   changes the numbers (the tokens per step among them: left out, the run's) must match ``run.json``; the latest
   complete ``step-N`` is loaded (a damaged one is named, with the previous complete step) and the run continues
   exactly (bitwise on CPU in fp32). The layout and world size, ``--micro-batch-tokens`` (left out: the run's),
   ``--compile`` and ``--recompute`` may change (only the rounding changes); ``run.json`` then records the new
   layout and launch. ``--stop-after N``
   ends a run early at step N (the schedule still spans ``--steps``). ``--restart`` starts a run folder again from
   scratch (it deletes only the files a run writes).
8. **Interrupt**: the first SIGINT (Ctrl-C) or SIGTERM lets the current step finish, saves its resume state and
   raises :class:`TrainInterrupted` (``kimi train``: one line, exit 130; 143 for SIGTERM); a second Ctrl-C stops at
   once.
9. **Divergence**: a step whose loss or gradient norm is not finite updates nothing; the run saves the state before
   it as ``step-(N-1)/`` (unless there already, or under ``--no-save``), writes :data:`DIVERGED` (step, loss,
   gradient norm, last good step) and ``loss.png``, and raises one line naming the step and the loss. The folder is
   then what ``--stop-after N-1`` would have left plus ``diverged.json``: ``--resume`` continues from step N-1
   (and removes the marker).

Under ``torchrun`` (:mod:`kimi_tools.train.parallel`): FSDP2 over all ranks, context parallelism over ``--cp`` ranks.
"""

from kimi_tools.train.args import TrainArgs
from kimi_tools.train.checkpoint import DIVERGED
from kimi_tools.train.cli import add_parser, cmd_train
from kimi_tools.train.interrupt import TrainInterrupted
from kimi_tools.train.metrics import RECORD_KEYS
from kimi_tools.train.schedule import lr_multiplier
from kimi_tools.train.stages import STAGES, LMStage, Stage
from kimi_tools.train.trainer import Trainer, TrainResult, train

__all__ = [
    "TrainArgs",
    "TrainResult",
    "Trainer",
    "train",
    "TrainInterrupted",
    "lr_multiplier",
    "Stage",
    "LMStage",
    "STAGES",
    "RECORD_KEYS",
    "DIVERGED",
    "add_parser",
    "cmd_train",
]
