"""One micro-batch's expert all-to-all behind another's compute inside DualPipeV's overlapped actions.

torch's ``ScheduleDualPipeV`` (``torch.distributed.pipelining``) pairs, in its steady state, the forward of one
micro-batch on one of a rank's two stages with the full backward of another micro-batch on the other stage as one
``OVERLAP_F_B`` action; without a callback its runtime runs the two one after the other. :func:`overlap_f_b` is that
callback (``schedule.register_custom_function(OVERLAP_F_B, overlap_f_b)``, registered by
``kernels_torch.parallel.pipeline.Pipeline(overlap_f_b=True)``): it runs the forward sub-action on the calling
thread (the *forward party*, ``F``) and the full-backward sub-action on a second thread (the *backward party*,
``B``), and the two **take turns**: a :class:`Turns` token says which party may run, and exactly one runs at any
time. A party hands the token over only at the expert all-to-alls of an expert-parallel MoE layer in the ``"fb"``
overlap modes (``kernels_torch.parallel.expert``): right after it has *issued* an asynchronous all-to-all
(``dist.all_to_all_single(async_op=True)``, the forward's dispatch and combine, the backward's reverse combine and
reverse dispatch) and before it *waits* for it. The other party then computes until its own next issue (or its end)
and hands the token back; the transfer travelled meanwhile. In the steady state of a rank whose two stages both hold
MoE layers this alternates::

    F: ... attention, router, issue dispatch(F) -> B: ... issue reverse combine(B)
    F: wait dispatch, experts, issue combine(F) -> B: wait, experts' backward, issue reverse dispatch(B)
    F: wait combine, weighted sum, next layer's attention, router, issue dispatch(F) -> B: wait, ... (and so on)

so each all-to-all of one micro-batch travels while the other micro-batch computes (DeepSeek-V3's DualPipe pairing,
on torch's own schedule and collectives).

**Correct by construction.** Both parties issue collectives on the same expert-parallel group (and FSDP2's on the
data-parallel one); issued from two threads at once they could reach the ranks of the group in different orders,
which gloo and NCCL match by order (a mismatch, or a hang). Under strict alternation the rank's code runs as one
sequential program whose switch points depend only on the code (which layers, in which order), never on timing; every
rank of an expert-parallel group runs the same actions of the same stages, so every rank issues its collectives in
one and the same order. The counts exchange of a dispatch (a small blocking all-to-all) runs inside a turn.

**Edge cases.** A party that finishes hands the token over for good: the other then runs alone (a stage with fewer
MoE layers, a stage without any: the embedding's or the head's alone, the dense first layers). A layer recomputed in
the backward (``torch.utils.checkpoint``) replays its forward all-to-alls inside the backward party's turn and hands
the token over at them as the backward's own (no pairing of counts between the parties is needed: a hand-over to a
party that has finished is a no-op). The last stage's loss is computed by the forward party
(``_maybe_compute_loss``) and read by the backward one (``_maybe_get_loss``) as torch's runtime does. The party is
told by thread: the calling thread is ``F``; any other thread reaching a hand-over while the action runs is ``B``
(its thread, or on CUDA the autograd engine's device thread that runs its backward nodes). An exception in either
party marks the action failed and wakes the other, which raises :class:`OverlapAborted` at its next hand-over (or
before starting); the callback re-raises the first party's own exception after joining the thread, never hangs on a
turn. A party reaching a hand-over without holding the token (two parties running at once) raises ``RuntimeError``.
On CUDA the backward thread sets the forward thread's device and current stream, so the device runs the kernels
in the order they were issued.

**What stays exposed.** Only the ``OVERLAP_F_B`` actions overlap; DualPipeV's warm-up forwards, its zero-bubble
``I``/``W`` backward parts, the cool-down's full backwards, and on the last rank the first steady-state pair (torch
runs it as a separate F and B to shorten the bubble) run alone, their all-to-alls exposed (or hidden in part by
``overlap="fb+chunks"``'s two chunks inside the layer). Per rank ``r`` of ``pp`` and ``M`` micro-batches a step,
torch's action list holds ``K = 2 M - 3 pp + r + 1`` ``OVERLAP_F_B`` actions (one fewer on the last rank; checked
against ``ScheduleDualPipeV``'s lists for pp 2 to 8): ``K`` of the rank's ``2 M`` stage-micro-batch forwards and
``K`` of its ``2 M`` backwards run in pairs, the other ``2 M - K`` of each (``3 pp - r - 1``, one more on the last
rank) alone, so nearly all once ``M >> pp`` (pp 4, M 16: 21 to 23 of 32).

**torch's runtime.** The callback re-states what torch 2.13's ``_PipelineScheduleRuntime._step_microbatches``
does for one ``FORWARD`` and one ``FULL_BACKWARD`` action (its ``_perform_action`` is a closure a callback cannot
call), through the runtime's private members (``fwd_recv_ops``, ``bwd_recv_ops``, ``backward_counter``,
``_maybe_compute_loss``, ``_maybe_get_loss``, ``_assert_unsharded``): a torch upgrade must check them. No
``loss_kwargs`` reach the loss and the last stage's output is not kept (``return_outputs=False``, as
``Pipeline.step`` runs the schedule).

**Memory.** No activation beyond the schedule's: in the sequential order the forward's activations are all alive
when the backward starts; taking turns, the backward frees its micro-batch's while the forward allocates, so the
peak is no higher. What it adds is the other party's transfer in flight at a hand-over: at most one more
all-to-all's send and receive buffers, one micro-batch's dispatched rows of one MoE layer, ``2 x N k x Dl``
elements (``N`` tokens of the micro-batch on the rank, ``k`` experts a token, ``Dl`` the latent width; K3.1 at
8,192 tokens in bf16: 2 x 0.94 GB), and the backward thread's stack.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["OverlapAborted", "Turns", "active_turns", "pass_turn", "overlap_f_b"]

_ACTIVE: Turns | None = None  # the turns of the OVERLAP_F_B action running in this process, if any


class OverlapAborted(RuntimeError):
    """Raised in one party of an overlapped action when the other party failed (its exception is the one the
    callback raises)."""


class Turns:
    """Strict alternation of two parties, ``"F"`` (the thread that made this object) and ``"B"`` (any other thread):
    a token that one holds at a time, handed over at :meth:`pass_turn`. ``F`` holds it first.

    Args:
        trace: None, or a list to which :meth:`log` and the parties' ends append events (``"F forward issue
            dispatch"``, ``"B end"``), in the order they happen.
    """

    def __init__(self, trace: list[str] | None = None):
        self._cv = threading.Condition()
        self._turn = "F"
        self._done: set[str] = set()
        self._failed = False
        self._forward_thread = threading.get_ident()
        self.trace = trace

    def party(self) -> str:
        """``"F"`` on the thread that made this object, else ``"B"``."""
        return "F" if threading.get_ident() == self._forward_thread else "B"

    def log(self, event: str) -> None:
        """Append ``"<party> <event>"`` to :attr:`trace` (if any)."""
        if self.trace is not None:
            self.trace.append(f"{self.party()} {event}")

    def _wait(self, me: str) -> None:  # holding self._cv
        self._cv.wait_for(lambda: self._turn == me or self._failed)
        if self._failed:
            raise OverlapAborted(f"overlapped forward + backward: party {me} stopped, the other party failed")

    def begin(self, me: str) -> None:
        """Block until party ``me`` holds the token (or the action failed: :class:`OverlapAborted`)."""
        with self._cv:
            self._wait(me)

    def pass_turn(self) -> None:
        """Hand the token to the other party and block until it comes back; a no-op once the other has ended.

        Raises:
            OverlapAborted: the other party failed. RuntimeError: the caller does not hold the token."""
        me = self.party()
        other = "B" if me == "F" else "F"
        with self._cv:
            if self._failed:
                raise OverlapAborted(f"overlapped forward + backward: party {me} stopped, the other party failed")
            if self._turn != me:
                raise RuntimeError(
                    f"overlapped forward + backward: party {me} reached a hand-over without holding the turn "
                    f"(party {self._turn} holds it): the two parties ran at once"
                )
            if other in self._done:
                return
            self._turn = other
            self._cv.notify_all()
            self._wait(me)

    def end(self, me: str) -> None:
        """Party ``me`` has finished: the token goes to the other party for good."""
        with self._cv:
            self._done.add(me)
            if self.trace is not None:
                self.trace.append(f"{me} end")
            if self._turn == me:
                self._turn = "B" if me == "F" else "F"
            self._cv.notify_all()

    def fail(self) -> None:
        """Mark the action failed and wake the other party (it raises :class:`OverlapAborted`)."""
        with self._cv:
            self._failed = True
            self._cv.notify_all()


def active_turns() -> Turns | None:
    """The :class:`Turns` of the overlapped action running now in this process, or None."""
    return _ACTIVE


def pass_turn() -> None:
    """Hand the turn to the other party of the running overlapped action (no-op outside one)."""
    turns = _ACTIVE
    if turns is not None:
        turns.pass_turn()


def _stage_map(schedule) -> dict:
    return {st.stage_index: st for st in schedule._stages}


def overlap_f_b(action, ctx, *, trace: list[str] | None = None) -> None:
    """The ``OVERLAP_F_B`` callback of a ``_PipelineScheduleRuntime`` (``ScheduleDualPipeV``): ``action.sub_actions``
    = (``FORWARD`` of micro-batch ``i`` on stage ``s``, ``FULL_BACKWARD`` of micro-batch ``j`` on stage ``s'``), both
    stages on this rank. Does what torch's runtime does for the two (waits the receives of ``fwd_recv_ops`` /
    ``bwd_recv_ops``, ``forward_one_chunk`` and ``_maybe_compute_loss``, ``backward_counter`` and
    ``backward_one_chunk``, the in-memory hand-over between the V's adjacent stages with ``set_local_fwd_input`` /
    ``set_local_bwd_input``; the sends stay torch's own actions after this one), the forward on this thread and the
    backward on a second one, taking turns at the expert all-to-alls (module docstring). ``trace``: a list for
    :class:`Turns`' events.

    Raises:
        whatever either sub-action raises (the first party's own exception; the other party is stopped);
        RuntimeError: an overlapped action already running in this process, or ``sub_actions`` not a forward and a
        full backward.
    """
    global _ACTIVE
    from torch.distributed.pipelining.schedules import FORWARD, FULL_BACKWARD, _wait_batch_p2p

    schedule = ctx.schedule_ref
    if action.sub_actions is None or [a.computation_type for a in action.sub_actions] != [FORWARD, FULL_BACKWARD]:
        raise RuntimeError(f"overlap_f_b: got {action!r}, expected a forward and a full backward as sub-actions")
    if _ACTIVE is not None:
        raise RuntimeError("overlap_f_b: an overlapped forward + backward is already running in this process")
    fa, ba = action.sub_actions
    stages = _stage_map(schedule)
    fs, bs = stages[fa.stage_index], stages[ba.stage_index]
    fi, bi = fa.microbatch_index, ba.microbatch_index
    # the receives each sub-action needs, as torch's runtime waits them (none from a stage of this rank: the V's tip)
    if not fs.is_first and fa.stage_index - 1 not in stages:
        _wait_batch_p2p(schedule.fwd_recv_ops.pop((fa.stage_index, fi)))
    if not bs.is_last and ba.stage_index + 1 not in stages:
        _wait_batch_p2p(schedule.bwd_recv_ops.pop((ba.stage_index, bi)))
    schedule._assert_unsharded(fs)
    schedule._assert_unsharded(bs)

    dev = fs.device
    stream = torch.accelerator.current_stream(dev) if dev.type != "cpu" else None
    turns = Turns(trace)
    errors: list[BaseException] = []  # in the order the parties failed

    def backward() -> None:
        try:
            if stream is not None:  # the forward thread's device and stream: the device runs kernels in issue order
                torch.accelerator.set_device_index(dev.index if dev.index is not None else 0)
                torch.accelerator.set_stream(stream)
            turns.begin("B")
            loss = schedule._maybe_get_loss(bs, bi)
            schedule.backward_counter[ba.stage_index] += 1
            last = schedule.backward_counter[ba.stage_index] == schedule._n_microbatches
            bs.backward_one_chunk(bi, loss=loss, full_backward=True, last_backward=last)
            if ba.stage_index - 1 in stages:
                stages[ba.stage_index - 1].set_local_bwd_input(bs.get_local_bwd_output(bi), bi)
        except BaseException as e:  # noqa: BLE001 (handed to the calling thread)
            errors.append(e)
            turns.fail()
        finally:
            turns.end("B")

    _ACTIVE = turns
    thread = threading.Thread(target=backward, name=f"overlap_f_b backward stage {ba.stage_index} mb {bi}")
    try:
        thread.start()
        try:
            out = fs.forward_one_chunk(fi, ctx.arg_mbs[fi], ctx.kwarg_mbs[fi], save_forward_output=False)
            schedule._maybe_compute_loss(fs, out, ctx.target_mbs, fi)
            if fa.stage_index + 1 in stages:
                stages[fa.stage_index + 1].set_local_fwd_input(out, fi)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            turns.fail()
        finally:
            turns.end("F")
            thread.join()
    finally:
        _ACTIVE = None
    if errors:  # the first to fail (one party runs at a time): the other party's is its OverlapAborted
        raise errors[0]
