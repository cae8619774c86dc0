"""What a decoding step costs on the GPU path, counted without a GPU: kernel launches, host-device syncs, bytes read.

On a GPU a decoding step is bound by launches and syncs before bytes: every aten op that computes is at least one
kernel launch, every Triton kernel is one, and a host-device sync (a tensor's value read on the host, an output
whose size depends on the data, a tensor copied from the host) stalls the launch queue. The GPU path runs on CPU
tensors (`HF_DELTAKV_KERNELS=triton`, Triton under `TRITON_INTERPRET=1`), so what it launches can be counted here:

- `LaunchCounter` counts, per layer, the aten ops a cache's `update` and its attention call run (a
  `TorchDispatchMode`; views, metadata and allocations launch nothing and are not counted), the Triton kernels they
  launch (each counted once, its interpreted innards not at all), and the syncs: `_local_scalar_dense` (`.item()`,
  `int()`, `bool()` of a tensor), ops whose output size depends on the data (`nonzero`, bool-mask indexing, ...),
  `.tolist()`, and any `.to(device)`, `.cpu()`, `.cuda()` or `torch.tensor(..., device=)` (on the GPU path nothing
  moves between host and device during a step: constants are made on the device once). The model's own work (its
  linears, norms, mask) is outside the count, so DynamicCache's step is its two concatenations and one SDPA (one
  fused aten op on the CPU, as on a GPU).
- `LoadTracer` hooks the interpreter's loads and records, per program of each Triton launch, the distinct bytes it
  loads (a program's own re-reads hit its caches on a GPU): summed over programs, what a kernel reads from memory.

Both are measurement tools (benchmarks/gpu_path.py, the tests' budgets); nothing in the library imports them.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that launch no kernel: views, metadata, allocation (an empty tensor is memory, not work).
NO_LAUNCH = {
    "view", "_unsafe_view", "reshape", "_reshape_alias", "slice", "select", "expand", "unsqueeze", "squeeze",
    "permute", "transpose", "t", "as_strided", "alias", "detach", "unbind", "split", "split_with_sizes", "chunk",
    "narrow", "diagonal", "view_as_real", "view_as_complex", "lift_fresh", "set_", "empty", "empty_strided",
    "new_empty", "new_empty_strided", "empty_like", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
    "is_same_size", "_has_compatible_shallow_copy_type", "resolve_conj", "resolve_neg", "conj", "_neg_view",
    "_conj", "unfold", "movedim", "swapaxes", "expand_as", "view_as", "squeeze_", "unsqueeze_", "transpose_",
    "as_strided_", "_nested_tensor_size", "is_nonzero_",
}  # fmt: skip
# aten ops that read a value back to the host, or whose output size depends on the data (the host waits for it).
SYNC_OPS = {
    "_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "argwhere", "_unique", "_unique2",
    "unique_dim", "unique_consecutive", "unique", "masked_scatter", "item",
}  # fmt: skip


def _name(func) -> str:
    return func.__name__.split(".")[0] if hasattr(func, "__name__") else str(func)


def _bool_index(args) -> bool:
    """An `index`/`index_put` whose indices hold a bool (or uint8) mask: its size depends on the data."""
    if len(args) < 2 or not isinstance(args[1], (list, tuple)):
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])


@dataclass
class Tally:
    """What one scope (one layer's update, or its attention call) ran."""

    ops: Counter = field(default_factory=Counter)  # aten op name -> count (launches)
    kernels: Counter = field(default_factory=Counter)  # Triton kernel name -> launches
    syncs: Counter = field(default_factory=Counter)  # what synced -> count
    largest: int = 0  # bytes of the largest new storage an op allocated (its outputs that view no input excluded)
    growths: int = 0  # stored buffers grown (and copied) into a larger one: the amortized, history-sized allocation

    @property
    def launches(self) -> int:
        return sum(self.ops.values()) + sum(self.kernels.values())

    @property
    def sync_count(self) -> int:
        return sum(self.syncs.values())

    def add(self, other: Tally) -> None:
        self.ops.update(other.ops)
        self.kernels.update(other.kernels)
        self.syncs.update(other.syncs)
        self.largest = max(self.largest, other.largest)
        self.growths += other.growths


class _Dispatch(TorchDispatchMode):
    def __init__(self, counter: LaunchCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tally = self.counter._current()
        if tally is not None:
            name = _name(func)
            if name in SYNC_OPS or (name in ("index", "index_put", "index_put_") and _bool_index(args)):
                tally.syncs[name] += 1
            if name not in NO_LAUNCH and name != "_local_scalar_dense":
                tally.ops[name] += 1
        out = func(*args, **(kwargs or {}))
        if tally is not None:
            tally.largest = max(tally.largest, _allocated(out, args, kwargs))
        return out


def _storages(tree) -> list[torch.UntypedStorage]:
    flat = tree if isinstance(tree, (tuple, list)) else (tree,)
    found = []
    for t in flat:
        if isinstance(t, (tuple, list)):
            found.extend(_storages(t))
        elif isinstance(t, torch.Tensor):
            found.append(t.untyped_storage())
    return found


def _allocated(out, args, kwargs) -> int:
    """Bytes of the largest storage among an op's outputs that is none of its inputs' (a view allocates nothing)."""
    given = {s.data_ptr() for s in _storages([*args, *(kwargs or {}).values()])}
    return max((s.nbytes() for s in _storages(out) if s.data_ptr() not in given), default=0)


def _names_device(args, kwargs) -> bool:
    """Whether a `.to(...)` call names a device (a device, a device string, or a tensor to match)."""
    candidates = [*args, kwargs.get("device"), kwargs.get("other")]
    return any(isinstance(a, (torch.device, str, torch.Tensor)) for a in candidates if a is not None)


def _replace_run(stack: contextlib.ExitStack, wrap) -> None:
    """`run` of Triton's launchable classes (interpreted and compiled, those importable) replaced by `wrap(run)` until
    `stack` closes: what `LaunchCounter` and `LaunchRecorder` see every launch through."""
    classes = []
    with contextlib.suppress(ImportError):
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    with contextlib.suppress(ImportError):
        from triton.runtime.jit import JITFunction

        classes.append(JITFunction)
    for cls in classes:
        run = cls.run
        cls.run = wrap(run)
        stack.callback(lambda cls=cls, run=run: setattr(cls, "run", run))


class LaunchCounter:
    """Counts what a cache's layers launch and sync, per layer and scope, while active (a context manager).

    Args:
        cache: the cache whose `update` is counted (each call attributed to its `layer_idx`).

    Attention calls are counted through transformers' attention functions (every implementation registered in
    `AttentionInterface`, attributed to the calling module's `layer_idx`). `steps` holds one dict per `step()`
    scope: `{layer: {"update": Tally, "attention": Tally}}`.
    """

    def __init__(self, cache) -> None:
        self.cache = cache
        self.steps: list[dict[int, dict[str, Tally]]] = []
        self._scope: list[tuple[int, str]] = []
        self._paused = 0
        self._stack = contextlib.ExitStack()

    def _current(self) -> Tally | None:
        if self._paused or not self._scope or not self.steps:
            return None
        layer, part = self._scope[-1]
        return self.steps[-1].setdefault(layer, {}).setdefault(part, Tally())

    @contextlib.contextmanager
    def scope(self, layer: int, part: str):
        self._scope.append((layer, part))
        try:
            yield
        finally:
            self._scope.pop()

    @contextlib.contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @contextlib.contextmanager
    def step(self):
        """One decoding step (one forward): its counts go to a new entry of `steps`."""
        self.steps.append({})
        yield self.steps[-1]

    def _sync(self, what: str) -> None:
        tally = self._current()
        if tally is not None:
            tally.syncs[what] += 1

    def __enter__(self) -> LaunchCounter:
        stack = self._stack
        counter = self
        update = self.cache.update

        def counted_update(key_states, value_states, layer_idx, *args, **kwargs):
            with counter.scope(layer_idx, "update"):
                return update(key_states, value_states, layer_idx, *args, **kwargs)

        self.cache.update = counted_update
        stack.callback(lambda: self.cache.__dict__.pop("update", None))
        self._wrap_attention(stack)
        self._wrap_triton(stack)
        self._wrap_tensor_methods(stack)
        self._wrap_growth(stack)
        stack.enter_context(_Dispatch(self))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _wrap_attention(self, stack: contextlib.ExitStack) -> None:
        from transformers.modeling_utils import AttentionInterface

        mapping = AttentionInterface._global_mapping
        saved = dict(mapping)
        counter = self

        def wrap(fn):
            def counted(module, *args, **kwargs):
                with counter.scope(getattr(module, "layer_idx", -1), "attention"):
                    return fn(module, *args, **kwargs)

            return counted

        for key, fn in saved.items():
            mapping[key] = wrap(fn)
        stack.callback(lambda: (mapping.clear(), mapping.update(saved)))

    def _wrap_triton(self, stack: contextlib.ExitStack) -> None:
        """Every Triton launch counts once (interpreted or compiled), its interpreter's own torch calls not at all."""
        counter = self

        def counting(run):
            def counted_run(fn, *args, **kwargs):
                tally = counter._current()
                if tally is not None and not kwargs.get("warmup", False):
                    tally.kernels[getattr(fn, "__name__", "triton")] += 1
                with counter.paused():
                    return run(fn, *args, **kwargs)

            return counted_run

        _replace_run(stack, counting)

    def _wrap_growth(self, stack: contextlib.ExitStack) -> None:
        """Counts the stored buffers grown into larger ones (`move_rows`: one call per grown buffer; an evicting cache's
        `kernels.compact_kept`)."""
        from hf_deltakv.codecs import base as codecs_base
        from hf_deltakv.layers import base as layers_base

        counter, move_rows = self, codecs_base.move_rows

        def counted(grown, stored):
            tally = counter._current()
            if tally is not None:
                tally.growths += 1
            return move_rows(grown, stored)

        for module in (codecs_base, layers_base):
            module.move_rows = counted
            stack.callback(lambda module=module: setattr(module, "move_rows", move_rows))
        from hf_deltakv import kernels

        compact = kernels.compact_kept  # an evicting cache's storage grown: its kept tokens copied into new buffers

        def compacted(*args):
            tally = counter._current()
            if tally is not None:
                tally.growths += 1
            return compact(*args)

        kernels.compact_kept = compacted
        stack.callback(lambda: setattr(kernels, "compact_kept", compact))

    def _wrap_tensor_methods(self, stack: contextlib.ExitStack) -> None:
        counter = self
        originals = {"to": torch.Tensor.to, "cpu": torch.Tensor.cpu, "cuda": torch.Tensor.cuda,
                     "tolist": torch.Tensor.tolist}  # fmt: skip

        def to(t, *args, **kwargs):
            if _names_device(args, kwargs):
                counter._sync("to(device)")
            return originals["to"](t, *args, **kwargs)

        def moved(name):
            def method(t, *args, **kwargs):
                counter._sync(name)
                return originals[name](t, *args, **kwargs)

            return method

        torch.Tensor.to = to
        for name in ("cpu", "cuda", "tolist"):
            setattr(torch.Tensor, name, moved(name))
        factories = {"tensor": torch.tensor, "as_tensor": torch.as_tensor}

        def factory(name):
            def make(*args, **kwargs):
                if kwargs.get("device") is not None:
                    counter._sync(f"torch.{name}(device=)")
                return factories[name](*args, **kwargs)

            return make

        for name in factories:
            setattr(torch, name, factory(name))

        def restore():
            for name, fn in originals.items():
                setattr(torch.Tensor, name, fn)
            for name, fn in factories.items():
                setattr(torch, name, fn)

        stack.callback(restore)


@dataclass
class Launch:
    """One recorded Triton launch: the kernel's name and Python source, its grid (a tuple of program counts), its
    arguments (constexprs among the keyword arguments) and the device whose guard it ran under (`common.on_device`;
    None: no guard, so torch's current device)."""

    kernel: str
    source: str
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict
    device: torch.device | None = None
    function: object = None  # the launched `JITFunction` (or the interpreter's `InterpretedFunction`)


class LaunchRecorder:
    """Records every Triton launch while active (a context manager), running none of them: the launchers can then be
    driven on `meta` tensors at sizes no machine here holds (batch 64 x 1M tokens), and `audit` checks each launch
    against what a GPU refuses and the interpreter does not (grid limits, int32 offsets)."""

    def __init__(self) -> None:
        self.launches: list[Launch] = []
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> LaunchRecorder:
        import inspect

        from ..kernels.triton.common import GUARDED

        recorder = self

        def recorded(fn, *args, grid=None, warmup=False, **kwargs):
            if warmup:
                return None
            python = getattr(fn, "fn", fn)
            grid = grid(kwargs) if callable(grid) else grid
            grid = tuple(int(n) for n in grid) + (1,) * (3 - len(grid))
            name = getattr(python, "__name__", "triton")
            guard = GUARDED[-1] if GUARDED else None
            recorder.launches.append(Launch(name, inspect.getsource(python), grid, args, kwargs, guard, fn))
            return None

        _replace_run(self._stack, lambda run: recorded)  # (nothing runs)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()


def _builder():
    """The Triton interpreter's builder (None without Triton)."""
    try:
        from triton.runtime.interpreter import interpreter_builder
    except ImportError:
        return None
    return interpreter_builder


def _replace_on_builder(stack: contextlib.ExitStack, builder, **methods) -> None:
    """Methods of the interpreter's `builder` replaced by `methods` (instance attributes over its class's) until
    `stack` closes, whatever an enclosing replacement had put there then put back."""
    saved = {name: vars(builder)[name] for name in methods if name in vars(builder)}
    vars(builder).update(methods)

    def restore():
        for name in methods:
            vars(builder).pop(name, None)
        vars(builder).update(saved)

    stack.callback(restore)


class ProgramOrder:
    """Runs each interpreted launch's programs in another order than the interpreter's grid loop (which runs them one
    after the other, in order, where a GPU runs them in any order and at once): `"reverse"`, `"shuffle"` (seeded), or
    `"alternate"` (launches reversed and shuffled in turn). A kernel whose result depends on the order of its programs
    (a race across programs, which the interpreter hides) then fails its tests; the tests run every launch this way
    (`tests/conftest.py`)."""

    ORDERS = ("reverse", "shuffle", "alternate")

    def __init__(self, order: str = "alternate", seed: int = 0) -> None:
        if order not in self.ORDERS:
            raise ValueError(f"order must be one of {self.ORDERS}, got {order!r}")
        self.order, self.launches = order, 0
        self._random = np.random.default_rng(seed)
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> ProgramOrder:
        builder = _builder()
        if builder is None:
            return self
        plain = type(builder)  # (the class's methods: an enclosing `ProgramOrder`'s are replaced, not composed)
        cells: list = []
        program = self

        def grid_dim(nx, ny, nz):
            plain.set_grid_dim(builder, nx, ny, nz)
            order = program.order if program.order != "alternate" else ("reverse", "shuffle")[program.launches % 2]
            program.launches += 1
            index = np.arange(nx * ny * nz)[::-1] if order == "reverse" else program._random.permutation(nx * ny * nz)
            cells[:] = [index.tolist(), 0, (ny, nz)]

        def grid_index(x, y, z):
            order, at, (ny, nz) = cells
            cell = order[at]
            cells[1] = at + 1
            plain.set_grid_idx(builder, cell // (ny * nz), cell // nz % ny, cell % nz)

        _replace_on_builder(self._stack, builder, set_grid_dim=grid_dim, set_grid_idx=grid_index)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()


class PerturbedDivision:
    """Makes the interpreter's floating-point `/` one ulp high (a nonzero result rounded up to the next float), as a
    GPU's approximate division may leave it, while `tl.math.div_rn` stays correctly rounded: a kernel that promises
    the reference's bytes and divides with `/` then fails its test. The tests run every launch this way
    (`tests/conftest.py`); `divisions` counts the perturbed ones."""

    def __init__(self) -> None:
        self.divisions = 0
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> PerturbedDivision:
        builder = _builder()
        if builder is None:
            return self
        plain = type(builder).create_fdiv
        perturbed = self

        def fdiv(lhs, rhs):
            out = plain(builder, lhs, rhs)
            if out.data.dtype in (np.float32, np.float64):
                up = np.nextafter(out.data, np.array(np.inf, out.data.dtype))
                out.data = np.where(out.data == 0, out.data, up)  # (a relative error: zero stays zero)
                perturbed.divisions += 1
            return out

        _replace_on_builder(self._stack, builder, create_fdiv=fdiv)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()


def compile_keys(launches: list[Launch], target: tuple = ("cuda", 90, 32)) -> dict[str, set]:
    """Per kernel, the distinct keys Triton's launcher would compile `launches` under for `target` (an NVIDIA H100 by
    default; no GPU needed): each key is one JIT compile during a run (integer arguments specialize on being 1 or a
    multiple of 16, pointers on 16-byte alignment, constexprs on their values, unless `do_not_specialize`)."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    backend = make_backend(GPUTarget(*target))
    binders, keys = {}, defaultdict(set)
    extra = {
        "debug": False,
        "instrumentation_mode": knobs.compilation.instrumentation_mode,
        "fpsan_homomorphic_casts": knobs.compilation.fpsan_homomorphic_casts,
    }  # fmt: skip (as `JITFunction.run`)
    for launch in launches:
        function = launch.function
        if id(function) not in binders:
            jitted = function if isinstance(function, JITFunction) else JITFunction(function.fn, **function.kwargs)
            binders[id(function)] = create_function_from_signature(jitted.signature, jitted.params, backend)
        _, specialization, options = binders[id(function)](*launch.args, **{**extra, **launch.kwargs})
        keys[launch.kernel].add(repr((specialization, options)))
    return dict(keys)


def audit(launch: Launch) -> list[str]:
    """What a GPU would refuse or get wrong in `launch`, as sentences (none: fine).

    - a grid axis past its limit (`common.GRID_LIMITS`: CUDA's and HIP's 2**31 - 1 on axis 0, 65,535 on axes 1 and 2);
    - a launch outside a device guard, or a tensor argument on another device than the guard's (Triton launches on
      the current device: with layers on several GPUs, another GPU's memory);
    - an offset that may not fit int32 in a kernel whose program ids are not widened to int64 (`common.program`): a
      tensor argument spanning 2**31 elements or more, or the largest program id of an axis times an integer
      argument (a stride) reaching 2**31."""
    from ..kernels.triton.common import GRID_LIMITS

    problems = [
        f"{launch.kernel}: grid axis {axis} has {n} programs (limit {limit})"
        for axis, (n, limit) in enumerate(zip(launch.grid, GRID_LIMITS, strict=True))
        if n > limit
    ]
    if launch.device is None:
        problems.append(f"{launch.kernel}: launched outside a device guard (on torch's current device)")
    problems += [
        f"{launch.kernel}: argument {i} is on {arg.device}, the launch on {launch.device}"
        for i, arg in enumerate(launch.args)
        if isinstance(arg, torch.Tensor) and launch.device is not None and arg.device != launch.device
    ]
    widened = "tl.program_id(" not in launch.source and "tl.num_programs(" not in launch.source
    if widened:
        return problems
    wide = 2**31
    for i, arg in enumerate(launch.args):
        if isinstance(arg, torch.Tensor) and arg.dim():
            extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(arg.shape, arg.stride(), strict=True))
            if extent >= wide:
                problems.append(f"{launch.kernel}: argument {i} spans {extent} elements in int32 offsets")
        elif isinstance(arg, int) and not isinstance(arg, bool):
            product = max(launch.grid) * abs(arg)
            if abs(arg) < wide <= product:
                problems.append(f"{launch.kernel}: program id {max(launch.grid) - 1} times argument {i} ({arg}) wraps")
    return problems


def per_layer(step: dict[int, dict[str, Tally]]) -> dict[int, Tally]:
    """A step's tallies summed over each layer's scopes."""
    out = {}
    for layer, parts in step.items():
        total = Tally()
        for tally in parts.values():
            total.add(tally)
        out[layer] = total
    return out


class LoadTracer:
    """Distinct bytes loaded by each program of each interpreted Triton launch while active (a context manager).

    `launches` holds `(kernel name, {program id: distinct bytes}, {program id: those of them in `shared`}, distinct
    bytes of `shared` over the launch)` per launch. `shared`: tensors every program of a launch may read (a decoder's
    weights), which a GPU's L2 serves after the first program (`bytes_by_kernel` counts them either way). Needs
    `TRITON_INTERPRET=1`.
    """

    def __init__(self, shared: list[torch.Tensor] = ()) -> None:
        self.launches: list[tuple[str, dict[tuple[int, int, int], int], dict[tuple[int, int, int], int], int]] = []
        self._ranges = [(t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
                        for t in shared]  # fmt: skip
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> LoadTracer:
        from triton.runtime import interpreter

        builder = interpreter.interpreter_builder
        masked_load = builder.create_masked_load
        tracer = self
        current: dict = {}

        def traced_load(ptrs, mask, other, cache_policy, is_volatile):
            width = max(ptrs.get_element_ty().primitive_bitwidth // 8, 1)
            addresses = np.asarray(ptrs.data).astype(np.uint64)[np.asarray(mask.data, dtype=bool)]
            if addresses.size:
                spans = (addresses[:, None] + np.arange(width, dtype=np.uint64)[None, :]).ravel()
                current.setdefault(tuple(builder.grid_idx), []).append(spans)
            return masked_load(ptrs, mask, other, cache_policy, is_volatile)

        builder.create_masked_load = traced_load
        self._stack.callback(lambda: setattr(builder, "create_masked_load", masked_load))
        run = interpreter.InterpretedFunction.run

        def traced_run(fn, *args, **kwargs):
            current.clear()
            try:
                return run(fn, *args, **kwargs)
            finally:
                tracer._record(fn.__name__, current)
                current.clear()

        interpreter.InterpretedFunction.run = traced_run
        self._stack.callback(lambda: setattr(interpreter.InterpretedFunction, "run", run))
        return self

    def _record(self, name: str, loads: dict) -> None:
        programs, shared = {}, {}
        for pid, parts in loads.items():
            spans = np.unique(np.concatenate(parts))
            inside = np.zeros(spans.shape, dtype=bool)
            for begin, end in self._ranges:
                inside |= (spans >= begin) & (spans < end)
            programs[pid], shared[pid] = int(spans.size), spans[inside]
        once = int(np.unique(np.concatenate(list(shared.values()))).size) if shared else 0
        self.launches.append((name, programs, {pid: int(s.size) for pid, s in shared.items()}, once))

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def bytes_by_kernel(self, shared: str = "per program") -> dict[str, int]:
        """Distinct bytes per program, summed over programs and launches, per kernel; the shared tensors' bytes counted
        `shared`: "per program" (as the rest), "once" (once per launch) or "not" (left out)."""
        out: dict[str, int] = defaultdict(int)
        for name, programs, in_shared, once in self.launches:
            total = sum(programs.values())
            out[name] += {"per program": total, "once": total - sum(in_shared.values()) + once,
                          "not": total - sum(in_shared.values())}[shared]  # fmt: skip
        return dict(out)


class MemoryTracker(TorchDispatchMode):
    """Peak bytes of the tensors allocated while active (a context manager): every aten op's outputs are recorded
    by storage (views share theirs), a storage being live while any tensor recorded over it is; `peak` is the largest
    live total seen after an op, `live()` the total now. Tensors made before it started are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[int, list]] = {}  # data_ptr -> (bytes, weak references of its tensors)
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                key = t.untyped_storage().data_ptr()
                size, refs = self.storages.get(key, (0, []))
                if not any(r() is not None for r in refs):  # a new storage (or a freed one's address reused)
                    size, refs = t.untyped_storage().nbytes(), []
                refs.append(weakref.ref(t))
                self.storages[key] = (max(size, t.untyped_storage().nbytes()), refs)
        self.peak = max(self.peak, self.live())
        return out

    def live(self) -> int:
        return sum(size for size, refs in self.storages.values() if any(r() is not None for r in refs))
