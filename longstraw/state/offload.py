"""State offload: the prompt state's per-token rows in host memory, staged to the
compute device one layer at a time (the paper's GLM-5.2 setup).

With `ExecConfig(state_device="cpu")`, capture allocates every per-token row of the
prompt state in host memory, as views of one host arena per state (`host_arena.py`;
exact mode's gradient rows in a second one), page-locked at its exact size when CUDA is available:

    attention K/V        `AttentionKV.k/.v`      [Hkv, S, D] / [Hkv, S, Dv]
    MLA latent rows      `LatentKV.k`            [1, S, R + Dr]
    DSA indexer keys     `IndexKeys.keys`        [S, Di]
    exact mode's dLoss/dState for them (fp32; fp64 for a float64 model), same shapes

Constant-size state (GDN recurrent and conv snapshots, a detached sliding-window
layer's last W - 1 rows) is not staged here; exact mode's earlier GDN snapshots go to
host memory by themselves (`ExecConfig.offload_snapshots`, `prompt.RecurrentState`). Under context parallelism each rank
holds (and offloads) its own shard's rows, S = its share of the positions.

A `Stager` owns two device slots, each sized for one layer's rows (and gradient sinks):

    the j-th layer with per-token rows  ->  slot j % 2

When layer j's attention asks for its state (`staged_layers`), the stager makes the
compute stream wait until slot j % 2 holds layer j's rows (copying them now if no
prefetch did), then starts copying layer j+1's rows into the other slot on a side CUDA
stream, after the compute queued so far (which may still read that slot). The copy
overlaps layer j's compute. On CPU the same code runs with plain copies.

What each phase does with the rows:

* capture: the chunk reads the slot, appends its new rows to the slot, and
  `write_back` copies those rows to host.
* replay / score / recompute (exact mode's reverse walk) / decode: read only.
* backward: the attention ops hold the prefix by reference (never saved), so by the
  time autograd reaches layer j's attention, slot j % 2 holds another layer. The
  attention output goes through `restage_on_backward`, an identity whose backward runs
  before that attention's backward (and after layer j+1's has finished, since layer
  j+1 reads layer j's output): it restages layer j into its slot, copying in the
  host's accumulated gradient rows (exact mode) as the slot's sink, and prefetches
  layer j-1 into the other slot after copying that slot's sink (layer j+1's
  gradient, now complete for this backward) back to host. `settle` copies the last
  sinks back after the backward. The gradient is thus accumulated on the device, in
  the same order of additions as with an on-device state (bitwise the same sums), and
  written back to host in its fp32 (fp64) dtype.

Traffic per layer visit: H2D of its rows before the visit (plus its gradient rows and
their D2H after, when backward accumulates into them); capture adds D2H of each
chunk's new rows. `StageStats` counts the bytes; the planner's `--offload-state`
figures count the same visits (`plan/offload.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from dataclasses import dataclass

import torch

from longstraw.state.host_arena import HostArena
from longstraw.state.prompt import AttentionKV, IndexKeys, LatentKV, MLAState, PromptState
from longstraw.tensors import accumulation_dtype, nbytes

# ----------------------------------------------------------------------------
# which parts of a layer are per-token rows


def has_rows(layer) -> bool:
    """Whether `layer` (a `PromptState.layers` entry) holds per-token rows that offload
    keeps in host memory (K/V of a full or untrimmed layer, MLA latents + indexer keys)."""
    if isinstance(layer, MLAState):
        return True
    return isinstance(layer, AttentionKV) and not layer.trim


def _holders(layer) -> list:
    """The row-holding objects of a layer: [AttentionKV] or [LatentKV, IndexKeys?]."""
    if isinstance(layer, MLAState):
        return [layer.latent] + ([layer.index] if layer.index is not None else [])
    return [layer]


def _row_fields(holder) -> tuple[str, ...]:
    if isinstance(holder, IndexKeys):
        return ("keys",)
    if isinstance(holder, LatentKV):
        return ("k",)  # v is a view of its first R columns
    return ("k", "v")


def _grad_fields(holder) -> tuple[str, ...]:
    if isinstance(holder, IndexKeys) or holder.k_grad is None:
        return ()
    return ("k_grad",) if isinstance(holder, LatentKV) else ("k_grad", "v_grad")


def _rows(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Rows [a, b) of a state tensor: dim 0 of indexer keys [S, Di], dim 1 otherwise."""
    return t[a:b] if t.dim() == 2 else t[:, a:b]


# ----------------------------------------------------------------------------
# the stager


@dataclass
class StageStats:
    """What a `Stager` moved and held (counted on every path, CPU and CUDA).

    Fields:
        h2d_bytes: host -> device bytes (rows and gradient rows staged in).
        d2h_bytes: device -> host bytes (capture's new rows, gradient rows back).
        fills: layer rows staged into a slot (a slot already holding them is not refilled).
        max_resident: most distinct layers whose rows sat in the slots at one time.
        slot_bytes: device bytes of the staging slots (rows and gradient sinks, both slots).
    """

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    fills: int = 0
    max_resident: int = 0
    slot_bytes: int = 0

    def reset(self) -> None:
        """Zero the counters (not the slots' size)."""
        self.h2d_bytes = self.d2h_bytes = self.fills = self.max_resident = 0


class Stager:
    """Stages one offloaded `PromptState`'s per-token rows to `device`, a layer at a time.

    Host memory: the per-token rows of every staged layer are views of one host arena
    (`host_arena.py`), and exact mode's gradient rows of a second one, pinned at their
    exact size on CUDA: `host_bytes` is what the planner's host bytes count.

    Args:
        state: the prompt state, fresh from `Adapter.new_state(host=True)`: its per-token
            rows are meta placeholders, which the stager replaces with arena views.
        device: the compute device (the model's).
    """

    def __init__(self, state: PromptState, device):
        self._state = weakref.ref(state)  # the state owns its stager: no cycle keeps either (or the slots) alive
        self.device = torch.device(device)
        self.order = [i for i, layer in enumerate(state.layers) if has_rows(layer)]
        self.rank = {idx: j for j, idx in enumerate(self.order)}
        self.buffers: list[dict] = [{}, {}]  # per slot: (holder i, field) -> device tensor, capacity-sized
        self.holds: list = [None, None]  # per slot: (layer idx, until) whose rows it holds
        self.sink_of: list = [None, None]  # per slot: (layer idx, until) whose gradient its sinks accumulate
        self.views: dict = {}  # layer idx -> the view handed out last
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.compute_stream = torch.cuda.current_stream(self.device) if self.cuda else None
        self.ready: list = [None, None]  # per slot: CUDA event, recorded after its last fill
        self.pending_d2h = False  # copies to host queued since the host last waited for them
        self.stats = StageStats()
        self.pin = torch.cuda.is_available()  # page-locked host rows (as before), so CUDA copies are asynchronous
        self.row_arena_bytes = self._place_rows(state)
        self.grad_arena_bytes = 0  # until `enable_grad_buffers`

    @property
    def state(self) -> PromptState:
        return self._state()

    @property
    def host_bytes(self) -> int:
        """Host bytes allocated for the state's rows and gradient rows (both arenas)."""
        return self.row_arena_bytes + self.grad_arena_bytes

    # --- host memory: one arena for the rows, one for the gradient rows ----------

    def _host_holders(self, state: PromptState) -> list:
        return [h for idx in self.order for h in _holders(state.layers[idx])]

    def _place_rows(self, state: PromptState) -> int:
        """Replace every staged layer's row placeholders by views of one host arena
        (a latent's value: a view of its key's first R columns). Returns its bytes."""
        holders = self._host_holders(state)
        fields = [(h, f) for h in holders for f in _row_fields(h)]
        assert all(getattr(h, f).is_meta for h, f in fields), "offloaded rows must be new_state(host=True) placeholders"
        arena = HostArena([(getattr(h, f).shape, getattr(h, f).dtype) for h, f in fields], pin=self.pin)
        for (h, f), view in zip(fields, arena.views):
            setattr(h, f, view)
        for h in holders:
            if isinstance(h, LatentKV):
                h.v = h.k[..., :h.v.shape[-1]]
        return arena.nbytes

    def enable_grad_buffers(self) -> None:
        """Exact mode: zeroed dLoss/dState for the state (`PromptState.enable_grad_buffers`).
        Staged layers' gradient rows (fp32; fp64 for fp64 rows) are views of one host
        arena, allocated afresh for each step (`release_grad_buffers` frees it when the
        step's walk has spent it); other layers allocate their own on the device."""
        state = self.state
        for i, layer in enumerate(state.layers):
            if layer is not None and i not in self.rank:
                layer.enable_grad_buffers()
        holders = [h for h in self._host_holders(state) if not isinstance(h, IndexKeys)]
        fields = [(h, f) for h in holders for f in (("k",) if isinstance(h, LatentKV) else ("k", "v"))]
        arena = HostArena([(getattr(h, f).shape, accumulation_dtype(h.k.dtype)) for h, f in fields],
                          pin=self.pin, zero=True)
        for (h, f), view in zip(fields, arena.views):
            setattr(h, f + "_grad", view)
        for h in holders:
            if isinstance(h, LatentKV):
                h.v_grad = h.k_grad[..., :h.v.shape[-1]]
        self.grad_arena_bytes = arena.nbytes

    def release_grad_buffers(self) -> None:
        """Forget the gradient arena (its views were dropped; the memory goes with them)."""
        self.grad_arena_bytes = 0

    # --- slots ------------------------------------------------------------------

    def _side(self):
        """The side stream (CUDA), after the work queued so far on the compute stream."""
        if not self.cuda:
            return contextlib.nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.stream)

    def _buffer(self, slot: int, key, like: torch.Tensor) -> torch.Tensor:
        """Slot `slot`'s device buffer for `key`, shaped and typed like the host tensor."""
        buf = self.buffers[slot].get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            if buf is not None:
                self.stats.slot_bytes -= nbytes(buf)
            if self.cuda:  # allocated on the compute stream, also used by the side stream's copies
                with torch.cuda.stream(self.compute_stream):
                    buf = torch.empty(like.shape, dtype=like.dtype, device=self.device)
                buf.record_stream(self.stream)
            else:
                buf = torch.empty(like.shape, dtype=like.dtype, device=self.device)
            self.buffers[slot][key] = buf
            self.stats.slot_bytes += nbytes(buf)
        return buf

    def _copy_in(self, slot: int, holders: list, until, fields_of) -> None:
        """Copy each holder's first rows (those before `until`) of the fields `fields_of`
        names (`_row_fields` or `_grad_fields`) from host into slot `slot`'s buffers."""
        for i, h in enumerate(holders):
            n = h.rows_before(until)
            for f in fields_of(h):
                src = _rows(getattr(h, f), 0, n)
                _rows(self._buffer(slot, (i, f), getattr(h, f)), 0, n).copy_(src, non_blocking=True)
                self.stats.h2d_bytes += nbytes(src)

    def _flush(self, slot: int) -> None:
        """Copy the slot's gradient sinks back to their host rows (queued on the side stream)."""
        if self.sink_of[slot] is None:
            return
        idx, until = self.sink_of[slot]
        self.sink_of[slot] = None
        with self._side():
            for i, h in enumerate(_holders(self.state.layers[idx])):
                n = h.rows_before(until)
                for f in _grad_fields(h):
                    host = _rows(getattr(h, f), 0, n)
                    host.copy_(_rows(self.buffers[slot][(i, f)], 0, n), non_blocking=True)
                    self.stats.d2h_bytes += nbytes(host)
                    self.pending_d2h = True

    def _fill(self, slot: int, idx: int, until: int, *, grads: bool) -> None:
        """Stage layer `idx`'s rows before position `until` into `slot` (unless it holds
        them); with `grads`, also its host gradient rows into the slot's sinks."""
        key = (idx, until)
        keep_sink = grads and self.sink_of[slot] == key  # already staged in (by a prefetch), not yet back
        if not keep_sink:
            self._flush(slot)
        holders = _holders(self.state.layers[idx])
        with self._side():
            if self.holds[slot] != key:
                self.holds[slot] = key
                self.stats.fills += 1
                self._copy_in(slot, holders, until, _row_fields)
            if grads and not keep_sink:
                self._copy_in(slot, holders, until, _grad_fields)
                self.sink_of[slot] = key
            if self.cuda:
                self.ready[slot] = torch.cuda.Event()
                self.ready[slot].record(self.stream)
        resident = {k[0] for k in self.holds if k is not None}
        self.stats.max_resident = max(self.stats.max_resident, len(resident))

    def _wait(self, slot: int) -> None:
        """Make the compute stream wait for the slot's last fill."""
        if self.cuda and self.ready[slot] is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready[slot])

    def _grads(self, idx: int) -> bool:
        return any(_grad_fields(h) for h in _holders(self.state.layers[idx]))

    def _view_of(self, slot: int, idx: int, until: int):
        """Layer `idx` as a state object whose tensors are the slot's buffers (full
        capacity, so capture can append), holding its rows before `until`."""
        def one(i, h):
            buf = self.buffers[slot]
            n = h.rows_before(until)
            if isinstance(h, IndexKeys):
                return dataclasses.replace(h, keys=buf[(i, "keys")], length=n)
            k = buf[(i, "k")]
            if isinstance(h, LatentKV):
                g = buf.get((i, "k_grad")) if h.k_grad is not None else None
                r = h.v.shape[-1]
                return dataclasses.replace(h, k=k, v=k[..., :r], length=n, k_grad=g,
                                           v_grad=None if g is None else g[..., :r])
            grads = h.k_grad is not None
            return dataclasses.replace(h, k=k, v=buf[(i, "v")], length=n,
                                       k_grad=buf[(i, "k_grad")] if grads else None,
                                       v_grad=buf[(i, "v_grad")] if grads else None)

        layer = self.state.layers[idx]
        if isinstance(layer, MLAState):
            holders = [one(i, h) for i, h in enumerate(_holders(layer))]
            return MLAState(latent=holders[0], index=holders[1] if len(holders) > 1 else None)
        return one(0, layer)

    # --- the interface the models call -------------------------------------------

    def view(self, idx: int, until: int):
        """Layer `idx` on the compute device with its rows before absolute position
        `until`, and layer idx's successor prefetched into the other slot."""
        j = self.rank[idx]
        slot = j % 2
        if self.holds[slot] != (idx, until):
            self._fill(slot, idx, until, grads=False)
        if self._grads(idx):  # the sinks must exist for the view (forward never reads them; backward fills them)
            for i, h in enumerate(_holders(self.state.layers[idx])):
                for f in _grad_fields(h):
                    self._buffer(slot, (i, f), getattr(h, f))
        self._wait(slot)
        if j + 1 < len(self.order):
            self._fill(1 - slot, self.order[j + 1], until, grads=False)
        view = self._view_of(slot, idx, until)
        self.views[idx] = view
        return view

    def write_back(self, idx: int) -> None:
        """Capture: copy the rows appended to layer `idx`'s view (in its slot) to host,
        and advance the host's counters."""
        view, layer = self.views[idx], self.state.layers[idx]
        with self._side():
            for h, v in zip(_holders(layer), _holders(view)):
                a, b = h.length, v.length
                for f in _row_fields(h):
                    dst = _rows(getattr(h, f), a, b)
                    dst.copy_(_rows(getattr(v, f), a, b), non_blocking=True)
                    self.stats.d2h_bytes += nbytes(dst)
                    self.pending_d2h = True
                h.length, h.consumed = v.length, v.consumed

    def count_written(self) -> None:
        """A divided capture wrote this rank's rows of every staged layer straight into
        their host rows (`parallel.divided.divided_capture`): count them as moved to host."""
        for idx in self.order:
            for h in _holders(self.state.layers[idx]):
                for f in _row_fields(h):
                    self.stats.d2h_bytes += nbytes(_rows(getattr(h, f), 0, h.length))

    def restage(self, idx: int, until: int) -> None:
        """Backward of layer idx's attention is next: stage its rows (and gradient sinks)
        again, and prefetch its predecessor's."""
        j = self.rank[idx]
        slot = j % 2
        self._fill(slot, idx, until, grads=self._grads(idx))
        self._wait(slot)
        if j > 0:
            prev = self.order[j - 1]
            self._fill(1 - slot, prev, until, grads=self._grads(prev))

    def settle(self) -> None:
        """After a run or a backward: copy pending gradient sinks back to host, and if
        anything was copied to host since the host last waited (capture's write-back, a
        backward's sinks), wait for it: the host rows are then valid for the CPU to read
        (the walk's seeds). A read-only pass (replay, score, every decoded token) queues
        no copy to host and so never blocks the host: its H2D copies and the next pass's
        are ordered on the side stream, and compute waits on events. The slots are then
        forgotten, so every pass (a forward, a backward) stages each layer it visits
        exactly once, whatever the previous pass left: the traffic the planner counts
        (`plan/offload.py`)."""
        for slot in (0, 1):
            self._flush(slot)
        if self.pending_d2h:
            self._sync_host()
        self.holds = [None, None]

    def _sync_host(self) -> None:
        """Block the host until every copy queued on the side stream is done (the one host
        sync; a no-op on CPU, where copies are synchronous)."""
        if self.cuda:
            self.stream.synchronize()
        self.pending_d2h = False


class _Restage(torch.autograd.Function):
    """Identity on an attention output [.., Dv]; its backward restages the layer's rows
    (`Stager.restage`) before autograd reaches the attention's own backward."""

    @staticmethod
    def forward(ctx, x, stager, idx, until):
        ctx.stager, ctx.idx, ctx.until = stager, idx, until
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.stager.restage(ctx.idx, ctx.until)
        return grad, None, None, None


# ----------------------------------------------------------------------------
# what the attention hooks call (identity for a state on the compute device)


def staged_layers(states: list[PromptState], idx: int, until: int) -> list:
    """Layer `idx` of each stacked state, for reading rows before `until`: the state's
    own object, or (offloaded) a view whose tensors live in the stager's slot."""
    return [s.offload.view(idx, until) if _staged(s, idx) else s.layers[idx] for s in states]


def stager_of(state: PromptState, idx: int):
    """The `Stager` that stages layer idx of `state`, or None (not offloaded)."""
    return state.offload if _staged(state, idx) else None


def _staged(state: PromptState, idx: int) -> bool:
    """Whether layer idx of `state` is offloaded (a trimmed window or GDN layer is not)."""
    return state.offload is not None and idx in state.offload.rank


def write_back(states: list[PromptState], idx: int) -> None:
    """Capture appended to layer idx of states[-1] (its view, if offloaded): copy to host."""
    if _staged(states[-1], idx):
        states[-1].offload.write_back(idx)


def restage_on_backward(out: torch.Tensor, states: list[PromptState], idx: int, until: int) -> torch.Tensor:
    """`out` (layer idx's attention output), wrapped so backward restages layer idx's
    rows of every offloaded state; `out` itself when there is none or no autograd."""
    if not torch.is_grad_enabled() or not out.requires_grad:
        return out
    for s in states:
        if _staged(s, idx):
            out = _Restage.apply(out, s.offload, idx, until)
    return out


def settle(states: list[PromptState]) -> None:
    """`Stager.settle` for every offloaded state among `states`."""
    for s in states:
        if s.offload is not None:
            s.offload.settle()
