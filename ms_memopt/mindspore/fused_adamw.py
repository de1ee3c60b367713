"""``FusedAdamW``: AdamW over flat, contiguous regions, one compiled FP32-domain step.

A drop-in for ``nn.AdamWeightDecay``. The layout:

* **parameter regions**: all parameters of one dtype moved into one contiguous buffer
  (``combine_tensor_list_contiguous``); every parameter is a view of it. Inside a region,
  parameters with the same learning rate and weight decay are adjacent: a *bucket*;
* **optimizer region**: per bucket, flat float32 ``Parameter``s ``m`` and ``v`` (and, for
  fp16/bf16 parameters, a float32 ``master``), in the order of the parameter region;
* **gradient region** (the device step): each step's gradients of one bucket concatenated, with
  the region's alignment padding, into one flat buffer *inside* the compiled update graph, so it
  is an ordinary pool allocation that goes back to the pool when the step ends. (Not
  ``combine_tensor_list_contiguous``: its buffers never return to the pool. On Ascend,
  ``AscendResManager::AllocDeviceMemoryForTensorList`` builds the pieces from a raw pointer
  with ``from_mem_pool`` false; on CPU, 30 combines of 512 KiB still held 15 MiB after every
  handle was deleted. A region formed per step leaked the whole gradient size every step.)
  The compiled CPU step needs none: it reads the gradients in place.

The parameter and optimizer regions are formed **once**, when the optimizer is built, and
live as long as the process (for the same reason). When something gives a parameter or a state
tensor new storage (a checkpoint load's ``set_data``), the step copies the new values into the
region and points the tensor back at its place there (``_rehome``): no second region.

One step on CPU (the library :mod:`ms_memopt.native` built, as ``pip install`` does with a C
compiler): one compiled AdamW pass over host memory (:func:`ms_memopt.native.adamw`),
straight on the parameter region (for fp16/bf16 parameters: the float32 master, then one
rounded write into the region), ``m``, ``v`` and each gradient where the backward pass left
it: decay, moments and update read each buffer once and write each once, in the calling
thread, with no graph launch and no gradient copy.
MindSpore's own CPU kernels cannot do that pass vectorised on this AMD CPU (see below).

One step elsewhere (the **device step**: Ascend, or CPU without the compiled library, or
``MS_MEMOPT_NATIVE=0``, which forces it so that the tests run the code an Ascend card runs):
one compiled graph (``ms.jit``, a single launch from Python) does, per bucket over its whole
range: gather the bucket's gradients into its flat gradient, cast it to float32 (fp16/bf16), decay the float32 weights in place
(``ApplyGradientDescent`` with the weights as their own delta: ``w -= lr * wd * w``), one
``ops.Adam`` kernel (m, v and weights in place), and for low-precision parameters write the
cast master into the parameter region once. For fp32 parameters the weights are the region
itself, so nothing is written back. ``nn.AdamWeightDecay`` runs one kernel per parameter.

Why ``ops.Adam`` plus a decay pass and not ``ops.AdamWeightDecay``: on CPU the latter's
vector code is chosen at run time for Intel AVX-512 only (MindSpore's nnacl checks the CPU
vendor), elsewhere it runs a scalar loop with double-precision sqrt and division (~3.5 ns
per element here, an AMD EPYC); ``ops.Adam``'s kernel is compiled with AVX for any x86
(~0.26 ns per element). Same arithmetic, float32 throughout.

Bias correction is exact algebra in ``ops.Adam``'s scalars (see ``_bias_terms``)::

    m_hat / (sqrt(v_hat) + eps) = m * (sqrt(c2) / c1) / (sqrt(v) + eps * sqrt(c2)),
    c1 = 1 - beta1**t, c2 = 1 - beta2**t

the kernel takes ``beta1**t`` and ``beta2**t`` and scales its learning rate by
``sqrt(c2) / c1`` itself; eps is passed as ``eps * sqrt(c2)``. The decay uses the plain
``lr * wd`` (decoupled).

Why not the alternatives (measured on CPU, see docs/pool_mode.md): per-parameter kernels are
what we replace; ``ops.FusedCastAdamWeightDecay`` keeps no float32 master and has no bias
correction (and is scalar off Intel too); ``mint.optim.FusedAdamW`` has no CPU kernel.

Works in PyNative mode (MindSpore's default), with ``Model.train``, MindFormers' ``Trainer``
and functional loops, as described above. **Graph mode** (``mode=GRAPH_MODE``, MindFormers'
``context.mode: 0``; decided when the optimizer is built, or ``graph=True/False``): a training
cell compiles the optimizer's ``construct`` into its own graph, where no Python runs per step,
so the step is MindSpore ops only (``FusedAdamWGraph.construct``): per parameter (``hyper_map``), the same
decay + ``ops.Adam`` (+ one fp16/bf16 write from the master) on the parameter's view in the
parameter region and on its own ``m``, ``v`` (and ``master``) Parameters, which are views into
**one** contiguous optimizer-region buffer (``combine_tensor_list_contiguous``; a compiled graph
updates Parameters where their storage is, so they stay there). Graph-mode state is per
parameter (``fused_adamw.m.<parameter name>``), so checkpoints do not carry over between the
two modes. What graph mode does not have: the gradient region (the graph compiler places the
gradients), the CPU host pass, and one kernel per bucket (the graph runs two per decayed
parameter).

The state (``m``, ``v``, ``master``, ``global_step``) is made of ``Parameter``s, so
``ms.save_checkpoint(optimizer, path)`` / ``load_param_into_net(optimizer, ...)`` round-trip.
Loading replaces parameter data (``set_data``), which breaks the views; the PyNative step
notices (data pointers no longer match) and rebuilds the region from the loaded values; in
graph mode call ``restore_regions()`` after loading (``CompactionCallback`` does after a
live compaction).

Example:
    >>> opt = FusedAdamW(net.trainable_params(), learning_rate=1e-3, weight_decay=0.01)  # doctest: +SKIP
    >>> train_step = nn.TrainOneStepCell(net_with_loss, opt)                             # doctest: +SKIP
"""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.hal.contiguous_tensors_handle import combine_tensor_list_contiguous

from ms_memopt import native
from ms_memopt.mindspore.regions import pin

__all__ = ["FusedAdamW", "FusedAdamWGraph", "Bucket"]


@dataclass
class Bucket:
    """Parameters updated by one kernel call: same dtype, learning rate and weight decay.

    A bucket is the sub-range ``[start, end)`` (in elements) of its dtype's region.

    Attributes:
        index: position in ``FusedAdamW.buckets``; names the state Parameters.
        dtype: parameter dtype.
        start, end: element range inside the dtype region (alignment padding included).
        first, count: which of the region's parameters (positions in ``param_indices``).
        weight_decay: decoupled weight decay of every parameter here.
        lr_index: which learning rate (index into the optimizer's lr tuple; 0 when not grouped).
    """

    index: int
    dtype: object
    start: int
    end: int
    weight_decay: float
    lr_index: int
    first: int = 0
    count: int = 0
    view: Tensor | None = None

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass
class DtypeRegion:
    """All parameters of one dtype in one contiguous buffer (the pool-mode parameter region).

    Attributes:
        dtype: element type.
        param_indices: positions in ``optimizer.parameters``, in region (address) order.
        numel: elements in the region.
        buckets: the kernel sub-ranges, in address order.
    """

    dtype: object
    param_indices: list[int]
    numel: int = 0
    buckets: list[Bucket] = field(default_factory=list)
    handle: object = None
    flat: Tensor | None = None
    data_ptrs: list[int] = field(default_factory=list)
    # where each parameter sits in its bucket: (bucket position in the region, byte offset in
    # it); the same offsets hold in the bucket's m, v and gradient buffers
    grad_targets: list[tuple[int, int]] = field(default_factory=list)
    # element offset of each parameter in ``flat`` (region order), and its padding after it
    offsets: list[int] = field(default_factory=list)
    paddings: list[int] = field(default_factory=list)

    @property
    def itemsize(self) -> int:
        return 4 if self.dtype == ms.float32 else 2

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


class FusedAdamW(nn.Optimizer):
    """AdamW with bias correction and decoupled weight decay over flat float32 regions.

    Update at step t (1-based)::

        m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g*g
        m_hat = m / (1 - b1**t);  v_hat = v / (1 - b2**t)      (if bias_correction)
        p = p - lr * (m_hat / (sqrt(v_hat) + eps) + wd * p)

    Args:
        params: list of ``Parameter``s, or parameter groups (dicts with ``params`` and
            optionally ``lr``, ``weight_decay``; plus ``order_params``) as MindSpore optimizers
            take them.
        learning_rate: float, Tensor, or ``LearningRateSchedule``.
        beta1, beta2, eps: Adam constants.
        weight_decay: decoupled weight decay (float). As in ``nn.AdamWeightDecay`` without
            groups, parameters whose name contains ``beta`` or ``gamma`` are not decayed.
        bias_correction: divide the moments by ``1 - beta**t``.
        graph: build the graph-mode step (MindSpore ops that a training cell compiles into its
            graph); default: whether the context is in graph mode now.

    The update runs in float32 for float32, float16 and bfloat16 parameters; low-precision
    parameters keep a float32 master copy in the optimizer state. Gradients must come in the
    parameter dtype (checked once, on the first step).
    """

    def __new__(cls, *args, graph: bool | None = None, **kwargs):
        # graph mode: a training cell compiles the optimizer's construct into its own graph, so
        # the step must be MindSpore ops only. A subclass holds that construct, so the compiler
        # never sees the Python step (with both in one construct behind `if self._graph`, the
        # compile inside MindFormers' wrapper resolved a PyNative-only method and failed).
        if cls is FusedAdamW and (ms.get_context("mode") == ms.GRAPH_MODE if graph is None else graph):
            cls = FusedAdamWGraph
        return super().__new__(cls, *args, **kwargs)

    def __init__(self, params, learning_rate=1e-3, beta1: float = 0.9, beta2: float = 0.999,
                 eps: float = 1e-6, weight_decay: float = 0.0, bias_correction: bool = True,
                 graph: bool | None = None) -> None:
        super().__init__(learning_rate, params, weight_decay)
        self._graph = isinstance(self, FusedAdamWGraph)
        if not 0.0 <= beta1 < 1.0 or not 0.0 <= beta2 < 1.0:
            raise ValueError(f"beta1 and beta2 must be in [0, 1), got {beta1}, {beta2}")
        if eps <= 0:
            raise ValueError(f"eps must be positive, got {eps}")
        if self.dynamic_weight_decay:
            raise ValueError("FusedAdamW takes a constant weight_decay per group, not a schedule Cell")
        self.beta1 = float(beta1)
        self.beta2 = float(beta2)
        self.eps = float(eps)
        self.bias_correction = bool(bias_correction)
        self._adam = ops.Adam()
        self._decay = ops.ApplyGradientDescent()
        self.regions: list[DtypeRegion] = self._make_regions()
        self.buckets: list[Bucket] = [b for r in self.regions for b in r.buckets]
        # CPU: the whole step is one compiled AdamW pass on host memory
        self._native = (not self._graph and _native_kernel() and all(r.dtype in _NATIVE_KIND for r in self.regions)
                        and self.global_step.dtype == ms.int32)
        for region in self.regions:
            self._combine(region)
        self._host_step = 0
        self._global_step_ptr = None
        self._grad_dtypes_checked = False
        if self._graph:
            self._make_graph_state()
            return
        zeros = lambda n: Tensor(np.zeros(n, np.float32))
        # ParameterTuples register the state with the Cell, so save_checkpoint(optimizer) has it.
        self.moments1 = ms.ParameterTuple(
            Parameter(zeros(b.numel), name=f"fused_adamw.m.{b.index}", requires_grad=False) for b in self.buckets)
        self.moments2 = ms.ParameterTuple(
            Parameter(zeros(b.numel), name=f"fused_adamw.v.{b.index}", requires_grad=False) for b in self.buckets)
        self._master_of: dict[int, int] = {}
        masters = []
        for b in self.buckets:
            if b.dtype != ms.float32:
                self._master_of[b.index] = len(masters)
                masters.append(Parameter(b.view.astype(ms.float32), name=f"fused_adamw.master.{b.index}",
                                         requires_grad=False))
        self.masters = ms.ParameterTuple(masters)
        self._plan = self._step_plan()
        self._gather = self._gather_plan()
        if self._native:
            self._pieces = self._native_pieces()

    # -- construction -------------------------------------------------------------------------
    def _make_regions(self) -> list[DtypeRegion]:
        params = list(self._parameters)
        wds = self._weight_decays()
        lr_ids = [id(self.learning_rate[i]) if self.is_group_lr else 0 for i in range(len(params))]
        by_key: dict[tuple, list[int]] = {}
        for i, p in enumerate(params):
            by_key.setdefault((str(p.dtype), lr_ids[i], wds[i]), []).append(i)
        regions: dict[str, DtypeRegion] = {}
        for (dtype_name, _, wd), indices in by_key.items():
            dtype = params[indices[0]].dtype
            region = regions.setdefault(dtype_name, DtypeRegion(dtype, []))
            numel = sum(int(np.prod(params[i].shape, dtype=np.int64)) for i in indices)
            bucket = Bucket(0, dtype, region.numel, region.numel + numel, wd,
                            indices[0] if self.is_group_lr else 0,
                            first=len(region.param_indices), count=len(indices))
            region.param_indices += indices
            region.numel += numel
            region.buckets.append(bucket)
        out = list(regions.values())
        for k, bucket in enumerate(b for r in out for b in r.buckets):
            bucket.index = k
        return out

    def _weight_decays(self) -> list[float]:
        if self.is_group:
            return [float(wd.asnumpy()) if flag else 0.0
                    for wd, flag in zip(self.weight_decay, self.decay_flags)]
        wd = float(self.weight_decay.asnumpy())
        return [wd if flag else 0.0 for flag in self.decay_flags]

    def _combine(self, region: DtypeRegion) -> None:
        """Move the region's parameters into one contiguous buffer and keep views of it."""
        params = [self._parameters[i] for i in region.param_indices]
        region.handle = combine_tensor_list_contiguous(params, True)
        pin(*params)
        # Devices that align each tensor (512 B on Ascend) pad between them; the buckets then
        # cover the padding too. Gradients of the same shapes and dtype are combined with the
        # same padding, so flat gradient, state and region stay aligned element by element.
        ends = np.cumsum([0] + [int(n) // region.itemsize for n in region.handle.after_padding_sizes])
        for bucket in region.buckets:
            bucket.start, bucket.end = int(ends[bucket.first]), int(ends[bucket.first + bucket.count])
        region.numel = int(ends[-1])
        region.flat = region.handle[0:region.numel]
        for bucket in region.buckets:
            bucket.view = region.handle[bucket.start:bucket.end]
        region.data_ptrs = [p.data_ptr() for p in params]
        region.offsets = [int(e) for e in ends[:-1]]
        region.paddings = [int(ends[j + 1] - ends[j]) - p.size for j, p in enumerate(params)]
        region.grad_targets = []
        for k, bucket in enumerate(region.buckets):
            for j in range(bucket.first, bucket.first + bucket.count):
                region.grad_targets.append((k, (int(ends[j]) - bucket.start) * region.itemsize))

    def _gather_plan(self) -> tuple:
        """Per bucket, in ``self.buckets`` order: ``((gradient index, padding elements), ...)``,
        the pieces the device step concatenates into the bucket's flat gradient, laid out like
        the bucket's range of the parameter region (padding included)."""
        plan = []
        for region in self.regions:
            for bucket in region.buckets:
                plan.append(tuple((region.param_indices[j], region.paddings[j])
                                  for j in range(bucket.first, bucket.first + bucket.count)))
        return tuple(plan)

    def _step_plan(self) -> tuple:
        """Per bucket, in ``self.buckets`` order, the constants the compiled step is built from:
        ``(learning-rate index, weight decay, index of its fp32 master or -1)``."""
        return tuple((b.lr_index, float(b.weight_decay), self._master_of.get(b.index, -1)) for b in self.buckets)

    def _ensure_regions(self) -> bool:
        """Bring parameters that were given new storage (checkpoint load, ``set_data``) back
        into their region (:func:`_rehome`); returns whether any moved. The region itself is
        never formed again: a second ``combine_tensor_list_contiguous`` would hold a second
        region that never returns to the pool."""
        moved = False
        for region in self.regions:
            params = [self._parameters[i] for i in region.param_indices]
            if not _rehome(region.flat, params, region.offsets, region.data_ptrs):
                continue
            moved = True
            for bucket in region.buckets:
                if bucket.dtype == ms.float32 or self._graph:   # graph mode: masters are in the state region
                    continue
                master = self.masters[self._master_of[bucket.index]]
                # A loaded optimizer checkpoint brings its own master; keep it when it matches
                # the loaded parameters, otherwise (weights loaded alone) restart from them.
                if not np.array_equal(master.astype(bucket.dtype).asnumpy(), bucket.view.asnumpy()):
                    master.copy_(bucket.view.astype(ms.float32))
        return moved

    # -- regions, for pool mode ---------------------------------------------------------------
    def region_bytes(self) -> dict[str, int]:
        """Bytes per region: ``parameters.<dtype>``, ``gradients``, ``optimizer`` (m, v, master)."""
        sizes = {f"parameters.{_dtype_name(r.dtype)}": r.nbytes for r in self.regions}
        sizes["gradients"] = sum(r.nbytes for r in self.regions)
        sizes["optimizer"] = sum(r.numel * 4 * (2 if r.dtype == ms.float32 else 3) for r in self.regions)
        return sizes

    # -- the step -----------------------------------------------------------------------------
    def _bias_terms(self, step: int) -> tuple[float, float, float]:
        """``(beta1**t, beta2**t, eps * sqrt(1 - beta2**t))`` for step t; zeros and eps without correction.

        ``ops.Adam`` takes the powers and scales its learning rate by ``sqrt(1 - beta2**t) /
        (1 - beta1**t)``; with eps scaled by ``sqrt(1 - beta2**t)`` its update is exactly
        ``m_hat / (sqrt(v_hat) + eps)``.
        """
        if not self.bias_correction:
            return 0.0, 0.0, self.eps
        b1p, b2p = self.beta1 ** step, self.beta2 ** step
        return b1p, b2p, self.eps * math.sqrt(1.0 - b2p)

    def _sync_step(self) -> None:
        """Re-read the step count when ``global_step`` was given new data (checkpoint load)."""
        ptr = self.global_step.data_ptr()
        if ptr != self._global_step_ptr:
            self._host_step = int(self.global_step.asnumpy().reshape(-1)[0])
            self._global_step_ptr = ptr

    def _check_grad_dtypes(self, gradients) -> None:
        # Reading .dtype waits for the backward pass, so this runs on the first step only.
        for region in self.regions:
            for i in region.param_indices:
                if gradients[i].dtype != region.dtype:
                    raise TypeError(f"gradient {i} has dtype {gradients[i].dtype}, its parameter "
                                    f"{self._parameters[i].name} has {region.dtype}; FusedAdamW "
                                    "expects gradients in the parameter dtype")
        self._grad_dtypes_checked = True

    def construct(self, gradients):
        """PyNative: the step runs from Python (region checks, the compiled CPU pass or one
        ``ms.jit`` update graph). Graph mode: :class:`FusedAdamWGraph`'s ``construct``."""
        if not self._grad_dtypes_checked:
            self._check_grad_dtypes(gradients)
        if self._native:
            return self._native_step(gradients)
        # the device step: the gradients go into the update graph as they are (strided ones made
        # contiguous first: ``is_contiguous`` reads host-side metadata only)
        grads = tuple(g if g.is_contiguous() else g.contiguous() for g in gradients)
        self._ensure_regions()
        self._sync_step()
        self._host_step += 1
        b1p, b2p, eps = self._bias_terms(self._host_step)
        # Scalars as Tensors: Python floats would be graph constants, one compile per step.
        self._update(tuple(b.view for b in self.buckets), grads,
                     Tensor(b1p, ms.float32), Tensor(b2p, ms.float32), Tensor(eps, ms.float32))
        return True

    # -- graph mode: the step compiled into the training graph --------------------------------
    def _make_graph_state(self) -> None:
        """Graph mode's state: one ``m``, ``v`` (and, for fp16/bf16, ``master``) float32
        ``Parameter`` per parameter, named ``fused_adamw.{m,v,master}.<parameter name>``, all
        moved into **one** contiguous buffer (``combine_tensor_list_contiguous``) in the order
        of the parameter region: m of every parameter, then v, then the masters. That buffer is
        the optimizer region; a compiled graph reads and updates Parameters where their storage
        is, so the views stay in it (checked: data pointers and the buffer's contents after
        graph-mode steps)."""
        params = list(self._parameters)
        order = [i for region in self.regions for i in region.param_indices]

        def state(prefix: str, i: int, init: Tensor | None = None) -> Parameter:
            value = init if init is not None else Tensor(np.zeros(params[i].shape, np.float32))
            return Parameter(value, name=f"fused_adamw.{prefix}.{params[i].name}", requires_grad=False)

        m = {i: state("m", i) for i in order}
        v = {i: state("v", i) for i in order}
        masters = {i: state("master", i, params[i].astype(ms.float32)) for i in order
                   if params[i].dtype != ms.float32}
        self.moments1 = ms.ParameterTuple(m[i] for i in range(len(params)))
        self.moments2 = ms.ParameterTuple(v[i] for i in range(len(params)))
        master_ids = sorted(masters)
        self.masters = ms.ParameterTuple(masters[i] for i in master_ids)
        self._master_of = {i: k for k, i in enumerate(master_ids)}   # parameter index -> master
        self._state_order = [m[i] for i in order] + [v[i] for i in order] + [masters[i] for i in order
                                                                               if i in masters]
        self._combine_state()
        # per parameter, graph constants: weight decay, whether 16-bit (updated through its
        # master); and the float32 weights the update runs on (the parameter or its master)
        self._graph_wd = tuple(float(wd) for wd in self._weight_decays())
        self._graph_low = tuple(i in masters for i in range(len(params)))
        self._weights32 = ms.ParameterTuple(masters.get(i, params[i]) for i in range(len(params)))
        # The step's scalars (beta**t, eps * sqrt(1 - beta2**t)) in float64 on CPU, as the
        # PyNative step computes them on the host: in float32, 1 - beta2**t loses ~1e-5 of its
        # value to cancellation early on (0.999 is not a float32). Devices: float32 (as
        # MindFormers' AdamW), where float64 kernels may be missing.
        scalar = ms.float64 if _host_memory() else ms.float32
        self._beta1 = Tensor(self.beta1, scalar)
        self._beta2 = Tensor(self.beta2, scalar)
        self._eps = Tensor(self.eps, scalar)
        self._one = Tensor(1.0, scalar)
        self._zero = Tensor(0.0, ms.float32)
        self._eps32 = Tensor(self.eps, ms.float32)

    def _combine_state(self) -> None:
        """Form the graph-mode optimizer region once (see ``_combine``)."""
        self._state_handle = combine_tensor_list_contiguous(self._state_order, True)
        pin(*self._state_order)
        ends = np.cumsum([0] + [int(n) // 4 for n in self._state_handle.after_padding_sizes])
        self._state_flat = self._state_handle[0:int(ends[-1])]
        self._state_offsets = [int(e) for e in ends[:-1]]
        self._state_ptrs = [p.data_ptr() for p in self._state_order]

    def restore_regions(self) -> bool:
        """Bring parameters and optimizer state back into their contiguous regions after
        something gave them separate storage (``set_data``, a checkpoint load); returns whether
        anything moved. Values are kept bit for bit, and no region is formed a second time
        (:func:`_rehome`).

        The PyNative step does this itself on the next step; in graph mode there is no Python
        per step: call it yourself after loading a checkpoint (then drop the compiled graphs,
        as :func:`ms_memopt.mindspore.compaction.restore_regions` does, so that they bind to
        the regions again).
        """
        moved = self._ensure_regions()
        if self._graph and _rehome(self._state_flat, self._state_order, self._state_offsets, self._state_ptrs):
            moved = True
        return moved

    # -- the CPU step: one compiled AdamW pass ------------------------------------------------
    def _native_pieces(self) -> dict:
        """Per parameter, in region order (one *piece* each): its gradient's index, its bucket
        (position in ``self.buckets``), its byte offset in the bucket's float32 state (m, v,
        master), its element count and its kind (``native.FLOAT32``/``FLOAT16``/``BFLOAT16``)."""
        order, bucket_of, offset, numel, kind = [], [], [], [], []
        first_bucket = 0
        for region in self.regions:
            for i, (k, byte_offset) in zip(region.param_indices, region.grad_targets):
                order.append(i)
                bucket_of.append(first_bucket + k)
                offset.append(byte_offset // region.itemsize * 4)
                numel.append(int(np.prod(self._parameters[i].shape, dtype=np.int64)))
                kind.append(_NATIVE_KIND[region.dtype])
            first_bucket += len(region.buckets)
        lr_of_bucket = [b.lr_index for b in self.buckets]
        kind = np.array(kind, np.int64)
        return {"order": order, "bucket": np.array(bucket_of, np.int64), "offset": np.array(offset, np.int64),
                "numel": np.array(numel, np.int64), "kind": kind, "low_precision": kind != native.FLOAT32,
                "lr_index": sorted(set(lr_of_bucket)),
                "bucket_lr": lr_of_bucket, "bucket_wd": [float(b.weight_decay) for b in self.buckets]}

    def _host_learning_rates(self) -> dict[int, float]:
        """This step's learning rate per index used by a bucket (before ``global_step`` moves)."""
        lrs = self.get_lr()
        if not self.is_group_lr:
            lrs = (lrs,)
        return {i: float(lrs[i].asnumpy().reshape(-1)[0]) for i in self._pieces["lr_index"]}

    def _native_step(self, gradients) -> bool:
        """CPU: ``ms_memopt.native.adamw`` straight on the parameters (or the float32 masters of
        16-bit ones), moments and gradients (host memory), one pass, in the calling thread; a
        16-bit parameter is written once from its master. ``data_ptr()`` of the
        gradients waits for the backward pass (the whole pipeline), so nothing still running
        reads the weights when they are rewritten."""
        pieces = self._pieces
        keep = [gradients[i] if gradients[i].is_contiguous() else gradients[i].contiguous() for i in pieces["order"]]
        grad_ptrs = [g.data_ptr() for g in keep]
        self._ensure_regions()
        self._sync_step()
        lrs = self._host_learning_rates()
        self._host_step += 1
        b1p, b2p, eps = self._bias_terms(self._host_step)
        correction = math.sqrt(1.0 - b2p) / (1.0 - b1p)
        f32 = np.float32
        decay = np.array([f32(lrs[lr]) * f32(wd) for lr, wd in zip(pieces["bucket_lr"], pieces["bucket_wd"])], f32)
        step = np.array([lrs[lr] * correction for lr in pieces["bucket_lr"]], f32)
        bucket = pieces["bucket"]
        offset = pieces["offset"]
        m_base = np.array([m.data_ptr() for m in self.moments1], np.int64)
        v_base = np.array([v.data_ptr() for v in self.moments2], np.int64)
        params = np.array([ptr for region in self.regions for ptr in region.data_ptrs], np.int64)
        low = pieces["low_precision"]
        weights, out = params, None
        if low.any():   # 16-bit: the update runs on the master, the parameter is the output
            master_base = np.array([self.masters[self._master_of[b.index]].data_ptr() if b.index in self._master_of
                                    else 0 for b in self.buckets], np.int64)
            weights = np.where(low, master_base[bucket] + offset, params)
            out = np.where(low, params, 0)
        native.adamw(weights, m_base[bucket] + offset, v_base[bucket] + offset, grad_ptrs, pieces["numel"],
                     decay[bucket], step[bucket], self.beta1, self.beta2, eps, out=out, kind=pieces["kind"])
        ctypes.c_int32.from_address(self.global_step.data_ptr()).value = self._host_step
        return True

    @ms.jit(backend="ms_backend")
    def _update(self, views, grads, beta1_power, beta2_power, eps):
        """Every bucket's update as one compiled graph: one launch from Python per step.

        Per bucket: its gradients concatenated (with the region's padding, ``_gather``) into
        one flat gradient, a graph temporary that goes back to the pool after the step; the fp32 weights (the region view itself, or the master of fp16/bf16
        parameters) decayed in place, ``w -= lr * wd * w`` (``ApplyGradientDescent`` with the
        weights as their own delta: one kernel, and exact where ``w * (1 - lr * wd)`` would lose
        small decays to float32 rounding near 1; ``AssignSub(w, w * (lr * wd))`` measured
        slower, two kernels and a temporary); one ``ops.Adam`` over the bucket (m, v, weights in
        place); for fp16/bf16 the master cast and copied into the region once.
        """
        lrs = self.get_lr()
        updated = []
        for k in range(len(self._plan)):
            lr_index, weight_decay, master_index = self._plan[k]
            lr = lrs[lr_index] if self.is_group_lr else lrs
            weights, grad = views[k], _flat_gradient(grads, self._gather[k], views[k].dtype)
            if master_index >= 0:
                weights = self.masters[master_index]
                grad = grad.astype(ms.float32)
            if weight_decay != 0.0:
                self._decay(weights, lr * weight_decay, weights)
            updated.append(self._adam(weights, self.moments1[k], self.moments2[k], beta1_power, beta2_power,
                                      lr, self.beta1, self.beta2, eps, grad))
            if master_index >= 0:
                updated.append(views[k].copy_(weights.astype(views[k].dtype)))
        updated.append(self.assignadd(self.global_step, self.global_step_increase_tensor))
        # A new tensor output that depends on every update. (A constant output made each call
        # wait for the graph, ~20% slower per step.)
        return ops.depend(eps * 1.0, updated)


class FusedAdamWGraph(FusedAdamW):
    """:class:`FusedAdamW` with its graph-mode step: what ``FusedAdamW(...)`` builds when the
    context is in graph mode (or with ``graph=True``). Same constructor, state layout described
    in ``FusedAdamW._make_graph_state``; its ``construct`` is MindSpore ops only, so a training
    cell can compile it into its graph."""

    def construct(self, gradients):
        """The step as MindSpore ops, compiled into the training graph (graph mode).

        Per parameter, in place on its views into the regions: the fp32 weights (the parameter,
        or the master of an fp16/bf16 one) decayed, ``w -= lr * wd * w``
        (``ApplyGradientDescent``), then one ``ops.Adam`` (m, v and weights), then for fp16/bf16
        the master written to the parameter once. Bias correction as in the PyNative step
        (``_bias_terms``), with ``beta**t`` computed in the graph from ``global_step`` (in
        float64 on CPU, as the host does; float32 on devices)."""
        lrs = self.get_lr()
        if self.bias_correction:
            step = ops.cast(self.global_step, self._one.dtype) + self._one
            beta1_power = ops.pow(self._beta1, step)
            beta2_power = ops.pow(self._beta2, step)
            eps = ops.cast(self._eps * ops.sqrt(self._one - beta2_power), ms.float32)
            beta1_power = ops.cast(beta1_power, ms.float32)
            beta2_power = ops.cast(beta2_power, ms.float32)
        else:
            beta1_power, beta2_power, eps = self._zero, self._zero, self._eps32
        # hyper_map, not a Python loop: graph mode unrolls a loop into nested calls, over the
        # call-depth limit at ~100 parameters
        if self.is_group_lr:
            updated = self.hyper_map(ops.partial(_graph_update, self._adam, self._decay, beta1_power, beta2_power,
                                                 eps, self.beta1, self.beta2),
                                     lrs, self._graph_wd, self._parameters, self._weights32, self.moments1,
                                     self.moments2, gradients, self._graph_low)
        else:
            updated = self.hyper_map(ops.partial(_graph_update, self._adam, self._decay, beta1_power, beta2_power,
                                                 eps, self.beta1, self.beta2, lrs),
                                     self._graph_wd, self._parameters, self._weights32, self.moments1,
                                     self.moments2, gradients, self._graph_low)
        return ops.depend(self.assignadd(self.global_step, self.global_step_increase_tensor), updated)


_graph_update = ops.MultitypeFuncGraph("fused_adamw_graph_update")


@_graph_update.register("Function", "Function", "Tensor", "Tensor", "Tensor", "Number", "Number", "Tensor",
                        "Number", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Bool")
def _graph_update_one(adam, decay, beta1_power, beta2_power, eps, beta1, beta2, lr, weight_decay, param,
                      weights, m, v, grad, low_precision):
    """One parameter's graph-mode update (``FusedAdamWGraph.construct``), in place: decay the
    float32 ``weights`` (the parameter, or its master), ``ops.Adam`` on weights, m, v; for a
    16-bit parameter, write the master into it once."""
    if low_precision:
        grad = ops.cast(grad, ms.float32)
    if weight_decay != 0.0:
        grad = ops.depend(grad, decay(weights, lr * weight_decay, weights))
    done = adam(weights, m, v, beta1_power, beta2_power, lr, beta1, beta2, eps, grad)
    if low_precision:
        done = ops.assign(param, ops.cast(ops.depend(weights, done), param.dtype))
    return done


#: parameter dtypes the compiled host step handles, and their ``native.adamw`` kind
_NATIVE_KIND = {ms.float32: native.FLOAT32, ms.float16: native.FLOAT16, ms.bfloat16: native.BFLOAT16}


def _rehome(flat: Tensor, tensors: list, offsets: list[int], data_ptrs: list[int]) -> bool:
    """Put each of ``tensors`` whose storage moved away from the region ``flat`` (its data
    pointer is no longer ``data_ptrs[i]``) back at element ``offsets[i]`` of it: its current
    values are copied there (``__setitem__`` on the region, in place on every device), then
    the tensor is given a view of that range (``set_data``). Returns whether any moved.

    Why not form the region again: ``combine_tensor_list_contiguous`` memory never returns to
    the pool, so every re-formed region would stay allocated beside the old one (measured on
    CPU: +1.4 MiB per re-forming in pool mode; on a 100B card, gigabytes)."""
    moved = False
    for tensor, offset, ptr in zip(tensors, offsets, data_ptrs):
        if tensor.data_ptr() == ptr:
            continue
        numel = int(np.prod(tensor.shape, dtype=np.int64))
        flat[offset:offset + numel] = tensor.reshape(-1)
        tensor.set_data(flat[offset:offset + numel].view(tuple(tensor.shape)))
        moved = True
    return moved


def _flat_gradient(grads, pieces, dtype):
    """Inside the update graph: one bucket's gradient as one flat tensor laid out like the
    bucket's range of the parameter region: ``pieces`` = ``((gradient index, padding
    elements), ...)``, the padding as zeros."""
    parts = []
    for index, padding in pieces:
        parts.append(grads[index].reshape(-1))
        if padding:
            parts.append(ops.zeros((padding,), dtype))
    return parts[0] if len(parts) == 1 else ops.concat(parts)


def _native_kernel() -> bool:
    """Whether the step can be the compiled host AdamW pass (:func:`ms_memopt.native.adamw`):
    tensors in host memory and the library built."""
    return _host_memory() and native.available()


def _host_memory() -> bool:
    """Whether tensors live in host memory (the CPU target), so their bytes can be copied by
    address."""
    return ms.get_context("device_target") == "CPU"


def _dtype_name(dtype) -> str:
    return {ms.float32: "float32", ms.float16: "float16", ms.bfloat16: "bfloat16"}.get(dtype, str(dtype))
