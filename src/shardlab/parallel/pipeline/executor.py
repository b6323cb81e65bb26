"""Run one rank's action list: forward and backward of its chunks, point-to-point between stages.

    stage = build_stage(model, plan_split(model, P), rank=pp_rank)
    runner = PipelineExecutor(stage, schedule("1f1b", P, M), pp_group)
    result = runner.run(x, y, on_step=optimizer_step)   # result.loss_tensor on every rank

Semantics (the ones simulation.py proves a schedule safe under, on gloo and NCCL alike):
  * The executor runs check()'s plan of the schedule (check.grouped: the same computes and
    sends, each receive moved to where NCCL's in-order groups cannot deadlock). The sends and
    receives between two computes are one group, posted at once with one `batch_isend_irecv`
    (NCCL runs it as one ncclGroupStart/End, so the sends and receives of a group never wait for
    one another; gloo posts them one by one, which its per-message matching makes equivalent).
  * Receives land in buffers kept between steps, one pool per (kind, chunk, shape): a buffer goes
    back to its pool only once the (weight-gradient) backward of its microbatch has run, because
    the received activation is an input of the chunk's forward that its backward reads (and BW's
    deferred matmuls read the received gradient), so a later receive cannot overwrite them.
  * A compute waits for the receive it needs (that wait is recorded as a WAIT event). A send is
    waited for, and its tensor freed, at the first action after which the simulation proves its
    group complete; the rest at the end of the step.
  * The last chunk scales each microbatch's mean loss by its share of the rows, so the gradients
    accumulated over microbatches are the gradient of the whole batch's mean loss, as one process
    computes it (microbatches may differ in size by one row when M does not divide the batch).
  * BI/BW split the backward (splitgrad.py); B runs it whole.
  * STEP: tied copies' gradients are summed across ranks (unless the caller does it in `on_step`:
    sum_tied=False), then `on_step` runs (data-parallel sync, clipping, the optimizer); without STEP
    in the list this happens after the last action.
  * Each chunk's last backward runs inside `final_backward()` when given (the overlapped
    data-parallel reduction of that chunk's gradients starts there, as Megatron-LM's does).
  * The loss is broadcast from the rank of the last chunk, so every rank returns it.
  * Validation mode (SHARDLAB_VALIDATE, or validate=True): before posting anything, the ranks agree
    on every message's shape and dtype and raise together on a disagreement (headers.py).

Every rank passes the same-shaped batch: the first chunk reads the inputs, the last the targets,
and every other rank only their shapes (to size its receive buffers). No global state: the pipeline
group is passed in, and its group ranks are the schedule's ranks.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardlab import comm
from shardlab.comm.validate import validation_enabled
from shardlab.dist import flight
from shardlab.models.dropout import rows_offset
from shardlab.models.moe import aux_loss_scope
from shardlab.parallel.pipeline.actions import B, BI, BW, F, RECV_B, RECV_F, SEND_B, SEND_F, STEP, Action, Schedule
from shardlab.parallel.pipeline.simulation import check
from shardlab.parallel.pipeline.headers import Header, Table, agree, check_send, header, is_message
from shardlab.parallel.pipeline.params import TIED_TAG, clip_grad_norm_, sum_tied_grads
from shardlab.parallel.pipeline.splitgrad import WeightGradStore, defer_weight_grads
from shardlab.parallel.pipeline.stages import PipelineStage
from shardlab.parallel.pipeline.timeline import WAIT, Event


@dataclass
class PipelineResult:
    loss_tensor: torch.Tensor
    """The whole batch's mean loss (this data-parallel replica's batch), on every pipeline rank: an
    fp64 scalar on the device, left unread (the trainer reads its steps' losses at logging steps)."""
    events: list[Event]
    """This rank's measured timeline (time.perf_counter seconds): merge ranks with Timeline.merge."""

    @property
    def loss(self) -> float:
        """The loss as a number: read back (a host synchronisation on a GPU), for callers that want it now."""
        return float(self.loss_tensor)


class PipelineExecutor:
    """Runs `schedule[group rank]` on `stage` over the pipeline process group `group`."""

    def __init__(self, stage: PipelineStage, schedule: Schedule, group: dist.ProcessGroup | None = None,
                 *, timeout_s: float | None = None, sum_tied: bool = True, validate: bool | None = None) -> None:
        # sum_tied=False: the caller sums the tied copies' gradients itself, in on_step (PipelineParallel:
        # before ZeRO's reduce-scatter, or after an overlapped data-parallel all-reduce).
        self.stage, self.group, self.timeout_s, self.sum_tied = stage, group, timeout_s, sum_tied
        self.validate = validation_enabled(validate)  # read once: nothing is exchanged or checked when off
        self.rank, size = dist.get_rank(group), dist.get_world_size(group)
        if len(schedule) != size:
            raise ValueError(f"the schedule has {len(schedule)} ranks but the pipeline group has {size}")
        if stage.rank != self.rank or stage.plan.stages != size:
            raise ValueError(f"stage built for rank {stage.rank} of {stage.plan.stages}, run on rank {self.rank} of {size}")
        self.sim = check(schedule)  # every rank checks the same lists: all refuse together, before any send
        # Kept between steps: receive buffers by (kind, chunk, shape), free ones ready for reuse.
        self.pool: dict[tuple, list[torch.Tensor]] = {}
        self.allocated = 0
        if self.sim.chunks != stage.plan.chunks:
            raise ValueError(f"the schedule runs {self.sim.chunks} chunks but the model is split into {stage.plan.chunks}")
        for c, r in self.sim.owners.items():
            if r != stage.plan.owner(c):
                raise ValueError(f"the schedule runs chunk {c} on rank {r}; the split placed it on {stage.plan.owner(c)}")
        self.actions = self.sim.schedule[self.rank]  # the grouped plan (receives moved, nothing else)
        self.group_at = {g[0]: g for g in self.sim.groups[self.rank]}
        self.microbatches, self.chunks = self.sim.microbatches, self.sim.chunks
        if 2 * self.microbatches * self.chunks + 2 >= TIED_TAG:
            raise ValueError(f"{self.microbatches} microbatches x {self.chunks} chunks exceed the message tags")
        self.last_rank = self.sim.owners[self.chunks - 1]
        self.split = {(a.microbatch, a.chunk) for a in self.actions if a.op == BI}
        # Each chunk's last backward (B, or BI under a split), after which its gradients are final
        # but for BW's deferred weight gradients: where an overlapped data-parallel sync may start.
        self.last_backward = {a.chunk: i for i, a in enumerate(self.actions) if a.op in (B, BI)}
        # Called with (microbatch, chunk) once that backward's weight gradients are in (after B, or
        # after BW under a split): train.deterministic takes them there (parallel/pipeline/tree_grads.py).
        self.after_backward: Callable[[int, int], None] | None = None
        self.dtype = next((p.dtype for p in stage.parameters() if p.is_floating_point()), torch.float32)

    def _tag(self, kind: str, mb: int, producer: int) -> int:
        return 1 + 2 * (mb * self.chunks + producer) + (kind == "B")

    def run(self, inputs: torch.Tensor, targets: torch.Tensor | None,
            on_step: Callable[[], None] | None = None, *, loss_scale: float = 1.0,
            final_backward: Callable[[], contextlib.AbstractContextManager[None]] | None = None) -> PipelineResult:
        """One step over the batch `inputs` (and `targets`, read by the last chunk). `loss_scale`:
        fp16's dynamic loss scale, multiplied into the loss before backward (the gradients come out
        that many times larger; the optimizer divides it back out); the loss returned is unscaled.
        `final_backward`: a context each chunk's last backward runs in (DataParallel.final_backward:
        the overlapped reduction of its gradients starts there)."""
        m = self.microbatches
        self.loss_scale = float(loss_scale)
        if inputs.shape[0] < m:
            raise ValueError(f"a batch of {inputs.shape[0]} rows cannot make {m} microbatches")
        self.xs = torch.tensor_split(inputs, m)
        self.ys = torch.tensor_split(targets, m) if targets is not None else [None] * m
        self.rows = inputs.shape[0]
        self.events: list[Event] = []
        self.recvs: dict[tuple[str, int, int], tuple[comm.Handle, torch.Tensor]] = {}
        self.lent: dict[tuple[int, int], list[tuple[tuple, torch.Tensor]]] = {}  # (pool key, buffer) by (mb, chunk)
        self.sends: dict[int, tuple[comm.Handle, torch.Tensor]] = {}
        self.saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.outgoing: dict[tuple[str, int, int], torch.Tensor] = {}   # tensors for sends and local hand-offs
        self.stores: dict[tuple[int, int], WeightGradStore] = {}
        self.loss = torch.zeros((), dtype=torch.float64, device=inputs.device)
        self.declared: dict[tuple[str, int, int], Header] = {}
        if self.validate:
            self._agree_on_messages(inputs.device)
        stepped = False
        for i, a in enumerate(self.actions):
            start = time.perf_counter()
            if a.is_comm:
                if i not in self.group_at:
                    continue  # posted with its group
                self._post_group(self.group_at[i], inputs.device)
            elif a.op == F:
                start = self._forward(a)
            elif a.op in (B, BI):
                last = final_backward is not None and self.last_backward[a.chunk] == i
                with final_backward() if last else contextlib.nullcontext():
                    start = self._backward(a)
                if a.op == B:
                    self._give_back(a.microbatch, a.chunk)
                    if self.after_backward is not None:
                        self.after_backward(a.microbatch, a.chunk)
            elif a.op == BW:
                self.stores.pop((a.microbatch, a.chunk)).flush()
                self._give_back(a.microbatch, a.chunk)
                if self.after_backward is not None:
                    self.after_backward(a.microbatch, a.chunk)
            elif a.op == STEP:
                self._finish(on_step)
                stepped = True
            end = time.perf_counter()
            # Posting can cost time too (gloo writes a message inline when its receiver is ready).
            if a.is_compute or a.op == STEP or end - start > 5e-5:
                self.events.append(Event(self.rank, a.op, a.microbatch, a.chunk, start, end))
            for j in self.sim.release[self.rank].get(i, []):
                self._wait_send(j)
        for j in list(self.sends):
            self._wait_send(j)
        if not stepped:
            self._finish(on_step)
        # The last chunk's loss plus every stage's load-balancing terms (zero where it has none).
        comm.all_reduce(self.loss, "sum", self.group, timeout_s=self.timeout_s)
        leftovers = [k for d in (self.saved, self.outgoing, self.stores, self.recvs, self.lent) for k in d]
        if leftovers:  # check() makes this impossible; a guard against state leaking into the next step
            raise RuntimeError(f"rank {self.rank}: pipeline state left over after the step: {leftovers[:4]}")
        return PipelineResult(self.loss, self.events)  # a fresh tensor each step: no later step writes it

    # ------------------------------------------------------------------------------ actions
    def _post_group(self, indices: list[int], device: torch.device) -> None:
        """Post the sends and receives at `indices` as one batch_isend_irecv."""
        ops: list[dist.P2POp] = []
        for j in indices:
            a = self.actions[j]
            kind = "F" if a.op in (SEND_F, RECV_F) else "B"
            if a.op in (SEND_F, SEND_B):
                t = self.outgoing.pop((kind, a.microbatch, a.chunk)).contiguous()
                if self.validate:
                    check_send(self.declared[(kind, a.microbatch, a.chunk)], t)
                tag = self._tag(kind, a.microbatch, a.chunk)
                ops.append(dist.P2POp(dist.isend, t, group=self.group, tag=tag, group_peer=a.peer))
            else:
                t = self._buffer(kind, a.chunk, self.stage.activation_shape(self.xs[a.microbatch]), device)
                tag = self._tag(kind, a.microbatch, a.chunk - 1 if kind == "F" else a.chunk + 1)
                ops.append(dist.P2POp(dist.irecv, t, group=self.group, tag=tag, group_peer=a.peer))
        works = dist.batch_isend_irecv(ops)
        for n, (j, op) in enumerate(zip(indices, ops)):
            a = self.actions[j]
            # gloo returns one work per message; NCCL one for the whole group (its wait covers all).
            mine = [works[n]] if len(works) == len(ops) else works
            name = "send" if a.op in (SEND_F, SEND_B) else "recv"
            record = flight.begin(name, self.group, op.tensor.shape, op.tensor.dtype, peer=a.peer, tag=op.tag)
            handle = comm.Handle(name, self.group, works=mine, timeout_s=self.timeout_s, record=record)
            if name == "send":
                self.sends[j] = (handle, op.tensor)
            else:
                self.recvs[("F" if a.op == RECV_F else "B", a.microbatch, a.chunk)] = (handle, op.tensor)

    def _agree_on_messages(self, device: torch.device) -> None:
        """Validation: every message's header, agreed by the whole pipeline group before any is posted.
        A message's shape is its stage's activation_shape of the microbatch, its dtype the stage's
        parameters' (what _buffer allocates on the receiving side and the chunks return)."""
        shapes: dict[int, tuple[int, ...]] = {}
        sends, recvs = [], []
        for a in self.actions:
            if not is_message(a):
                continue
            if a.microbatch not in shapes:
                shapes[a.microbatch] = tuple(self.stage.activation_shape(self.xs[a.microbatch]))
            h = header(a, self.rank, shapes[a.microbatch], self.dtype)
            if h.sender == self.rank:
                sends.append(h)
                self.declared[(h.kind, a.microbatch, a.chunk)] = h
            else:
                recvs.append(h)
        agree(Table(self.rank, self.rows, self.microbatches, sends, recvs), self.group, device, self.timeout_s)

    def _buffer(self, kind: str, chunk: int, shape: torch.Size, device: torch.device) -> torch.Tensor:
        free = self.pool.setdefault((kind, chunk, tuple(shape), device), [])
        if free:
            return free.pop()
        self.allocated += 1
        return torch.empty(shape, dtype=self.dtype, device=device)

    def _take(self, kind: str, mb: int, c: int) -> torch.Tensor:
        """The received tensor, lent to (mb, c) until its backward has run (see _give_back)."""
        start = time.perf_counter()
        handle, buf = self.recvs.pop((kind, mb, c))
        handle.wait()
        self.events.append(Event(self.rank, WAIT, mb, c, start, time.perf_counter()))
        self.lent.setdefault((mb, c), []).append(((kind, c, tuple(buf.shape), buf.device), buf))
        return buf

    def _give_back(self, mb: int, c: int) -> None:
        """(mb, c)'s backward is complete (B, or BW after BI): nothing reads its received tensors any
        more, so their buffers may take the next receives."""
        for key, buf in self.lent.pop((mb, c), []):
            self.pool[key].append(buf)

    def _wait_send(self, index: int) -> None:
        handle, _ = self.sends.pop(index)
        start = time.perf_counter()
        handle.wait()
        end = time.perf_counter()
        if end - start > 1e-4:  # only waits long enough to matter clutter the timeline
            self.events.append(Event(self.rank, WAIT, -1, -1, start, end))

    def _forward(self, a: Action) -> float:
        mb, c = a.microbatch, a.chunk
        if c == 0:
            inp = self.xs[mb]
        elif self.stage.plan.owner(c - 1) == self.rank:
            inp = self.outgoing.pop(("L", mb, c - 1)).detach().requires_grad_()
        else:
            # A new leaf over the pooled buffer: the buffer itself never joins a graph or holds .grad.
            inp = self._take("F", mb, c).detach().requires_grad_()
        start = time.perf_counter()
        last = c == self.chunks - 1
        defer = contextlib.nullcontext()
        if (mb, c) in self.split:
            store = self.stores[(mb, c)] = WeightGradStore()
            defer = defer_weight_grads(store)
        share = self.xs[mb].shape[0] / self.rows
        # A chunk without the head carries its MoE layers' load-balancing terms on its output, with
        # the gradient the loss gives them (models/moe.py); their values join the reported loss.
        first_row = sum(x.shape[0] for x in self.xs[:mb])  # dropout's coordinates (models/dropout.py)
        with defer, aux_loss_scope(share, self.loss_scale) as aux, rows_offset(first_row):
            out = self.stage.chunk(c)(inp, self.ys[mb] if last else None)
        self.loss += aux.total
        if last:
            # Each microbatch's loss is a mean over its rows: weighting by its share of the rows
            # makes the sum over microbatches (and its gradient) the whole batch's mean.
            out = out * share
            self.loss += out.detach().double()
        else:
            local = self.stage.plan.owner(c + 1) == self.rank
            self.outgoing[("L" if local else "F", mb, c)] = out if local else out.detach()
        self.saved[(mb, c)] = (inp, out)
        return start

    def _backward(self, a: Action) -> float:
        mb, c = a.microbatch, a.chunk
        inp, out = self.saved.pop((mb, c))
        grad = None
        if c < self.chunks - 1:
            if self.stage.plan.owner(c + 1) == self.rank:
                grad = self.outgoing.pop(("G", mb, c + 1))
            else:
                grad = self._take("B", mb, c)
        elif self.loss_scale != 1.0:
            grad = torch.full_like(out, self.loss_scale)  # d(scale x loss) / d(loss)
        start = time.perf_counter()
        # A first chunk whose parameters are all frozen or bypassed this step (train.task's
        # skip_layer) produces an output with no graph: nothing in it needs a gradient.
        if out.requires_grad:
            torch.autograd.backward(out, grad)
        if c > 0:
            local = self.stage.plan.owner(c - 1) == self.rank
            # An output that does not depend on the input has a zero gradient with respect to it.
            self.outgoing[("G" if local else "B", mb, c)] = inp.grad if inp.grad is not None else torch.zeros_like(inp)
        return start

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The whole model's gradient norm over the pipeline group, clipping to `max_norm` (the
        method `train_step` looks for on a model whose gradients are spread over ranks)."""
        return clip_grad_norm_(self.stage, max_norm, self.group)

    def _finish(self, on_step: Callable[[], None] | None) -> None:
        if self.sum_tied:
            sum_tied_grads(self.stage, self.group)
        if on_step is not None:
            on_step()
