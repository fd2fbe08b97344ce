"""`RehearsalFakeMode`: torch's `FakeTensorMode` with a cheaper dispatch, for rehearsals only.

A rehearsal's time is its number of fake ops times the cost of one: at the paper's
P = 2,088,960 about 4.5M ops. Profiled (`bench/profile_rehearse.py`), 78% of a fake op was
`FakeTensorMode`'s own Python: building the cache key (`_prep_args_for_hash`, which turns
each tensor argument into a `TensorMetadata` dataclass and flattens it field by field)
and rebuilding a cache hit's output (`FakeTensor.__new__`, context managers). This mode
keeps torch's cache and its entries, and what a hit returns, and does the same work
with less Python:

- **The key** (`_prep_args_for_hash`): for each fake tensor argument the fields torch's
  `TensorMetadata` holds, read directly into the key (dtype, shape, stride, device,
  storage offset, storage bytes, requires_grad, quantized / conj / neg / inference
  flags; a non-strided tensor bypasses the cache). `memory_format` is left out: torch
  derives it from the shape and strides, which the key holds. Scalars go in with their
  type, as torch's do; anything else is keyed by torch's own function. Every key holds
  a private marker, so it never equals a key of a plain `FakeTensorMode` (the cache is
  shared by every fake mode of the process). The key can only be finer than torch's,
  never coarser: a hit returns what torch's cache would have returned.
- **A hit's output** (`_get_output_tensor_from_cache_entry`): the same meta tensor,
  made the same way, wrapped as a `FakeTensor` with the attributes `FakeTensor.__new__`
  sets (`fake_tensor_like`).
- **The dispatch** (`dispatch`, `__torch_dispatch__`): torch's, without its debug log
  call and its per-op `torch._dynamo` guard (nothing is compiled inside a rehearsal).
  `aten._unsafe_view`, which torch's cache refuses ("unsafe view": a fresh-storage cache
  hit would be wrong, its output shares its input's storage) and so dispatches in full
  every time (6 times per layer per capture chunk, from `linear` on 3-d inputs), is
  answered as `aten.view` (ATen's `_unsafe_view` is `view_impl`: the same sizes, strides
  and storage), which the cache serves as a view of the input. Below autograd, where a
  fake mode runs, the two differ in nothing else.

With a shape environment (symbolic shapes), debug logging or
`cache_crosscheck_enabled`, each falls back to torch's own code. `fake_tensor_like`
checks itself against `FakeTensor(...)` once per process (`_self_check`): a torch
whose `FakeTensor` gained attributes raises rather than rehearsing wrongly. The tests
(tests/rehearsal/test_fast_fake.py) run a rehearsal in this mode and in torch's
and require every figure equal, and run this mode with torch's cross-check (every cache
hit compared with a fresh dispatch).
"""

from __future__ import annotations

import logging
import os

import torch
from torch._subclasses import fake_tensor as ft
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

_KEY = object()  # marks every key this mode builds (never in a plain FakeTensorMode's)
_TENSOR, _SEQ, _DICT, _TORCH = object(), object(), object(), object()
_SCALARS = frozenset({int, float, bool, str, type(None), complex, torch.dtype, torch.device, torch.layout,
                      torch.memory_format, torch.Size})  # a Size holds ints (no shape env: no SymInts)
_UNSAFE_VIEW, _VIEW = torch.ops.aten._unsafe_view.default, torch.ops.aten.view.default
_MEMOS = ("nonzero_memo", "item_memo", "unique_memo", "unique_consecutive_memo", "nested_int_memo")
_MEMO_ATTRS = tuple(a for m in _MEMOS for a in (f"_{m}", f"_{m}_vc", f"_{m}_epoch"))
_checked = False


def fake_tensor_like(mode: FakeTensorMode, elem: torch.Tensor, device: torch.device) -> FakeTensor:
    """`FakeTensor(mode, elem, device)` for a meta `elem` and an already normalised
    fake `device` (one read off a FakeTensor): the same tensor, fewer Python calls."""
    t = torch.Tensor._make_subclass(FakeTensor, elem, elem.requires_grad, dispatch_device=True,
                                    device_for_backend_keys=device)
    if mode._allow_unsafe_data_ptr_access:
        torch._C._set_warn_deprecated_on_mutable_data_ptr(t)
    else:
        torch._C._set_throw_on_mutable_data_ptr(t)
    d = t.__dict__
    d["_fake_device"] = device
    d["fake_mode"] = mode
    d["constant"] = d["pytype"] = d["dispatch_keys"] = d["real_tensor"] = None
    for a in _MEMO_ATTRS:
        d[a] = None
    return t


def _self_check(mode: FakeTensorMode) -> None:
    """Raise if `fake_tensor_like` no longer makes what `FakeTensor(...)` makes."""
    global _checked
    elem = torch.empty_strided((2, 3), (3, 1), device="meta")
    device = torch.device("cpu")
    want, got = FakeTensor(mode, elem, device), fake_tensor_like(mode, elem, device)
    if (want.__dict__.keys() != got.__dict__.keys() or any(want.__dict__[k] is not got.__dict__[k]
                                                           for k in want.__dict__ if k != "_fake_device")
            or want.fake_device != got.fake_device
            or torch._C._dispatch_key_set(want) != torch._C._dispatch_key_set(got)):
        raise RuntimeError("RehearsalFakeMode: this torch's FakeTensor differs from the one fake_tensor_like "
                           f"builds ({sorted(want.__dict__)} vs {sorted(got.__dict__)}); rehearse with "
                           "longstraw.rehearsal.fast_fake off (torch's FakeTensorMode)")
    _checked = True


def fake_mode(**kwargs) -> FakeTensorMode:
    """The fake mode a rehearsal runs in: `RehearsalFakeMode(**kwargs)`, or torch's
    `FakeTensorMode(**kwargs)` where the environment sets `LONGSTRAW_FAST_FAKE=0`
    (bench/bench_rehearse.py measures both in one run)."""
    if os.environ.get("LONGSTRAW_FAST_FAKE", "1") == "0":
        return FakeTensorMode(**kwargs)
    return RehearsalFakeMode(**kwargs)


class RehearsalFakeMode(FakeTensorMode):
    """`FakeTensorMode` with a cheaper key, hit and dispatch (see the module docstring).
    Same constructor arguments as `FakeTensorMode`."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # our __torch_dispatch__ below is not wrapped in torch._dynamo's disable

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not _checked:
            _self_check(self)

    def _fast(self) -> bool:
        return self.shape_env is None  # (torch's cross-check, when on, still runs: in _cached_dispatch_impl)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.dispatch(func, types, args, kwargs or {})

    def dispatch(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if ft.log.isEnabledFor(logging.DEBUG) or not self._fast():
            return super().dispatch(func, types, args, kwargs)
        handler = ft._DISPATCH_META_HANDLERS.get(func)
        if handler is not None:
            return handler(args)
        if func in ft._DISPATCH_HANDLE_DIRECTLY:
            with ft.in_kernel_invocation_manager(self):
                return func(*args, **kwargs)
        if self.cache_enabled:
            if func is _UNSAFE_VIEW:  # torch never caches it; its kernel is view's (same output, same storage)
                func = _VIEW
            return self._cached_dispatch_impl(func, types, args, kwargs)
        return self._dispatch_impl(func, types, args, kwargs)

    def _prep_args_for_hash(self, result, args, state, id_hashed_objects) -> None:
        if not self._fast():
            return super()._prep_args_for_hash(result, args, state, id_hashed_objects)
        append = result.append
        if isinstance(args, dict):
            result += (_KEY, _DICT, len(args))
            self._prep_args_for_hash(result, tuple(args.keys()), state, id_hashed_objects)
            self._prep_args_for_hash(result, tuple(args.values()), state, id_hashed_objects)
            return
        result += (_KEY, _SEQ, type(args), len(args))
        for arg in args:
            kind = type(arg)
            if kind is FakeTensor:
                if arg.fake_mode is not self:
                    raise ft._BypassDispatchCache("not our fake")
                if arg.constant is not None:
                    raise ft._BypassDispatchCache("constant attribute")
                if arg.layout is not torch.strided:
                    raise ft._BypassDispatchCache(f"{arg.layout} tensor")
                result += (_TENSOR, arg.dtype, arg.shape, arg.stride(), arg.device, arg.storage_offset(),
                           arg.untyped_storage().nbytes(), arg.requires_grad, arg.is_quantized, arg.is_conj(),
                           arg.is_neg(), arg.is_inference())
            elif kind in _SCALARS:
                append(kind)
                append(arg)
            elif kind is list or kind is tuple or kind is dict:
                self._prep_args_for_hash(result, arg, state, id_hashed_objects)
            else:  # any other argument: keyed (or refused) by torch's own rule
                append(_TORCH)
                FakeTensorMode._prep_args_for_hash(self, result, (arg,), state, id_hashed_objects)

    def _get_output_tensor_from_cache_entry(self, state, entry, key, func, args):
        if not self._fast() or (entry.inplace_idx is None and entry.metadata is None and entry.view_idx is None) \
                or entry.inplace_idx is not None or entry.metadata is None:
            return super()._get_output_tensor_from_cache_entry(state, entry, key, func, args)
        m = entry.metadata
        view = isinstance(func, torch._ops.OpOverload) and func.is_view
        prev = self.in_kernel_invocation
        with torch._C._DisableTorchDispatch(), torch._C._PreserveDispatchKeyGuard():
            self.in_kernel_invocation = True
            torch._C._set_meta_in_tls_dispatch_include(True)
            try:
                empty = torch.empty_strided(m.shape, m.stride, dtype=m.dtype, layout=m.layout, device="meta",
                                            requires_grad=m.requires_grad)
                if m.is_conj:
                    torch._C._set_conj(empty, True)
                if m.is_neg:
                    torch._C._set_neg(empty, True)
                if view:  # a view's storage is its input's
                    storage = args[entry.view_idx].untyped_storage()
                    empty.set_(storage, m.storage_offset, m.shape, m.stride)
            finally:
                self.in_kernel_invocation = prev
        return fake_tensor_like(self, empty, m.device)
