"""An FP8 (e4m3) KV cache as transformers ``Cache`` objects: ``Fp8DynamicCache`` and ``Fp8StaticCache``.

    cache = Fp8DynamicCache(config=model.config)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=64)      # greedy, sampling or beam search
    cache = Fp8StaticCache(config=model.config, max_cache_len=4096)

K and V are stored in the format of ``llm_attn.kv_cache_reference`` (its docstring is the spec): float8_e4m3fn
(B, H, S, D) plus one float32 scale per (batch, KV head, 64-token block), K smoothed by a per-channel shift. Per
model layer, the layers here are transformers 5.x's own layer classes (``DynamicLayer``, ``StaticLayer``) with the
storage replaced, so every Cache operation goes through transformers' code: ``update``, ``get_seq_length``,
``get_mask_sizes``, ``reorder_cache`` (beam search), ``crop``, ``batch_select_indices`` / ``batch_repeat_interleave``
(dynamic), ``reset``, ``get_max_length`` (static: the capacity).

``update`` quantises the new tokens and returns a dequantised copy of the whole layer in the model's dtype: what
stock attention needs (the honest baseline: stock attention has no way to read FP8). That copy carries the raw
data and scales (``kv_cache_reference.fp8_kv_of``), and ``cache.fp8(layer_idx)`` gives them too. When the cache was
made with the model's ``config`` and the model runs llm_attn's attention function (``patch_model``:
``config._attn_implementation == "llm_attn"``, read at every update), ``update`` returns placeholders of the copy's
shape instead (``kv_cache_reference.is_placeholder``; no memory): the patched attention reads the FP8 data directly
(``llm_attn.ops.decode_fp8_kv``: the decode kernel) or makes the copy itself for a call the direct path does not
take, and the patch report counts each ("fp8 cache read directly by the decode kernel" / "... via dequantised copy").

Not supported (transformers 5.17): ``cache_implementation="fp8"``. Its ``generate`` accepts a fixed tuple of names
(``GenerationConfig.validate``, ``ALL_CACHE_IMPLEMENTATIONS``) and builds each cache by name in
``_prepare_cache_for_generation``, with no registry; pass the cache as ``past_key_values=`` instead. Models with
sliding-window or linear-attention layers are refused (full attention only, as transformers' ``QuantizedCache``).
The static variant keeps its write position on the host by default, so it is not ``torch.compile``-able
(``is_compileable`` is False, and generate does not try); a step that the user compiles traces the host path's ops, with
``device_position`` too, and attention reads the dequantised copy. ``Fp8StaticCache(..., device_position=True)`` makes
its decode steps capturable in a CUDA graph (what ``llm_attn.harness.measure``'s graph decode does): a one-token update
then runs on the device alone. It writes the token into the open block's float32 originals (a fixed 64-slot buffer) at
the position held in ``cumulative_length``, re-quantises that block from them (K's shift too while block 0 is open),
and, for llm_attn's attention function, returns placeholders of the whole capacity with the used length as a device
tensor (``Fp8KV.used``, the decode kernel's ``seqused_k``). The stored bytes and scales are the host path's, bit for
bit. Stock attention gets the copy: while a graph is captured, of the whole capacity (transformers builds the causal
mask during a capture, and it hides the slots past the used length, as for its own ``StaticCache``), so stock
attention's decode step on the FP8 cache is capturable too (the honest baseline of a graph decode); eagerly, of the used
tokens (their number read back: one sync), the host path's result. The first device step after a host-side update
refills the open block's buffers from the host's tail, so it must run eagerly, not under capture. On a GPU that step is
one launch per layer (``llm_attn.ops.fp8_cache_append``, kernels/fp8_cache_append.h: the AOT build, and the NVRTC build,
which compiles the same kernel at first use); elsewhere (CPU, an extension built before the kernel) the same arithmetic
runs as ~35 PyTorch ops, each a kernel in the graph (measured on the 8B: ~2-3 ms per token, more than the FP8 cache
saves at 32k context). Every other call (a prefill, beam reordering) first reads the position back (one sync). Past
``max_cache_len`` the device path clamps its writes and the next host read raises IndexError.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer, StaticLayer, get_layer_types_and_kwargs

from llm_attn import kv_cache_reference as ref
from llm_attn import ops


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (what transformers' mask code checks, too)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _attn_implementation(config) -> str | None:
    """``config._attn_implementation``, read from the instance's dict where transformers keeps it
    (``_attn_implementation_internal``, what the property returns): the property through ``PreTrainedConfig``'s
    ``__getattribute__`` costs ~3 µs, on every layer of every decoded token. Any other config: the property."""
    try:
        d = object.__getattribute__(config, "__dict__")  # past that __getattribute__ too (~2.5 µs there)
    except AttributeError:
        d = {}
    if "_attn_implementation_internal" in d:
        return d["_attn_implementation_internal"]
    return getattr(config, "_attn_implementation", None)


_BATCHED = ("k_data", "v_data", "k_scale", "v_scale", "k_shift", "k_tail", "v_tail")  # tensors with a batch dim


class _Fp8Storage:
    """The FP8 storage of one layer, shared by the dynamic and the static layer: the data and scales, K's shift,
    the float32 tail (original values of the open block's tokens) and the host-side length."""

    def _init_storage(self, key_states: torch.Tensor, value_states: torch.Tensor, capacity: int) -> None:
        if value_states.shape[-1] != key_states.shape[-1]:
            raise ValueError(f"the FP8 cache needs K and V of one head_dim, got {key_states.shape[-1]} and "
                             f"{value_states.shape[-1]}")
        self.dtype, self.device = key_states.dtype, key_states.device  # the dtype update returns K/V in
        self._allocate(*key_states.shape[:2], key_states.shape[-1], capacity)

    def _allocate(self, b: int, h: int, d: int, capacity: int) -> None:
        self.k_data = torch.zeros((b, h, capacity, d), dtype=ref.STORAGE_DTYPE, device=self.device)
        self.v_data = torch.zeros_like(self.k_data)
        self.k_scale = torch.ones((b, h, ref.n_blocks(capacity)), dtype=torch.float32, device=self.device)
        self.v_scale = torch.ones_like(self.k_scale)
        self.k_shift = torch.zeros((b, h, d), dtype=torch.float32, device=self.device)
        self.k_tail = torch.zeros((b, h, 0, d), dtype=torch.float32, device=self.device)
        self.v_tail = torch.zeros_like(self.k_tail)
        self.length = 0
        self.keys, self.values = self.k_data, self.v_data  # transformers' generic code reads shapes off these

    def _write_open(self, k_open: torch.Tensor, v_open: torch.Tensor) -> None:
        """Quantise the open tokens (every token from the first non-full block on, original values in float32)
        into place, and keep the ones of the last partial block as the new tail."""
        full = self.length // ref.BLOCK  # blocks before the open ones: frozen
        start, n = full * ref.BLOCK, k_open.shape[2]
        if full == 0 and n > 0:  # block 0 is open: its median is K's shift until the block is full
            self.k_shift = ref.smoothing_shift(k_open[:, :, :ref.BLOCK])
        kq, ks = ref.quantize(k_open, self.k_shift)
        vq, vs = ref.quantize(v_open, None)
        self._store(start, full, kq, ks, vq, vs)
        kept = (n // ref.BLOCK) * ref.BLOCK
        self.k_tail, self.v_tail = k_open[:, :, kept:].clone(), v_open[:, :, kept:].clone()
        self.length = start + n

    def _open_tokens(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """The tail's originals followed by the new tokens, float32."""
        return (torch.cat([self.k_tail, key_states.to(torch.float32)], dim=2),
                torch.cat([self.v_tail, value_states.to(torch.float32)], dim=2))

    def _dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``update`` returns: the whole layer dequantised in the model's dtype, K and V tagged with their
        Fp8KV; placeholders (no values, no memory) where llm_attn's attention function reads the FP8 data itself."""
        view = self.fp8()
        n = self._returned_tokens()
        if self._attention_reads_fp8():
            return self._placeholders(n, view)
        # One launch where the build has it (ops.fp8_kv_dequantized: the reference's values, bit for bit).
        k, v = ops.fp8_kv_dequantized(view if view.length == n else self._fp8_view(n), self.dtype)
        setattr(k, ref.FP8_KV_ATTR, view)
        setattr(v, ref.FP8_KV_ATTR, view)
        return k, v

    def _placeholders(self, n: int, view: ref.Fp8KV) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``n`` tokens that hold no values (a zero-stride view of one zero), tagged with ``view``: one
        tensor returned as both (nothing reads values from either). Every layer of every decoded token pays this on
        the host, so it makes one view, not two (issue 38 item 5)."""
        zero, data = getattr(self, "_zero", None), self.k_data
        if zero is None or zero.device != data.device or zero.dtype != self.dtype:
            self._zero = zero = torch.zeros((), dtype=self.dtype, device=data.device)
        b, h, _, d = data.shape
        t = zero.expand(b, h, n, d)  # unpacked sizes: half the host time of expand(tuple) on torch 2.x
        setattr(t, ref.FP8_KV_ATTR, view)
        setattr(t, ref.FP8_PLACEHOLDER_ATTR, True)
        return t, t

    def _attention_reads_fp8(self) -> bool:
        """Whether the model this cache serves runs llm_attn's attention function now (which reads placeholders).
        Never while torch.compile traces: the traced attention cannot look for the FP8 view, so it gets the copy."""
        if torch.compiler.is_compiling():  # first: dynamo cannot trace _attn_implementation's object.__getattribute__
            return False
        config = getattr(self, "attn_config", None)
        return config is not None and _attn_implementation(config) == "llm_attn"

    def fp8(self) -> ref.Fp8KV:
        """The raw FP8 data and scales (the storage itself, not a copy) and the number of valid tokens."""
        return self._fp8_view(self.length)

    def _fp8_view(self, length: int, used: torch.Tensor | None = None) -> ref.Fp8KV:
        return ref.Fp8KV(self.k_data, self.k_scale, self.k_shift, self.v_data, self.v_scale, length,
                         trusted=True, used=used)

    def _index_batch(self, fn) -> None:
        for name in _BATCHED:
            setattr(self, name, fn(getattr(self, name)))
        self.keys, self.values = self.k_data, self.v_data

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._index_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def offload(self):
        if self.is_initialized:
            self._index_batch(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        if self.is_initialized and self.k_data.device != self.device:
            self._index_batch(lambda t: t.to(self.device, non_blocking=True))


class Fp8DynamicLayer(_Fp8Storage, DynamicLayer):
    """A ``DynamicLayer`` whose K/V are FP8 (``kv_cache_reference``): grows with every update, as transformers'
    does (the full blocks are kept, the open block is re-quantised with the new tokens)."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._init_storage(key_states, value_states, capacity=0)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._write_open(*self._open_tokens(key_states, value_states))
        return self._dequantized()

    def _store(self, start: int, full: int, kq, ks, vq, vs) -> None:
        self.k_data = torch.cat([self.k_data[:, :, :start], kq], dim=2)
        self.v_data = torch.cat([self.v_data[:, :, :start], vq], dim=2)
        self.k_scale = torch.cat([self.k_scale[:, :, :full], ks], dim=2)
        self.v_scale = torch.cat([self.v_scale[:, :, :full], vs], dim=2)
        self.keys, self.values = self.k_data, self.v_data

    def _returned_tokens(self) -> int:
        return self.length

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def reset(self) -> None:
        if self.is_initialized:
            b, h, _, d = self.k_data.shape
            self._allocate(b, h, d, capacity=0)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove ``tokens_to_remove`` tokens (a negative count, transformers >= 5.16; a positive value is the
        legacy "final length", as ``DynamicLayer.crop`` still accepts). The block the cut falls in becomes the open
        block and is re-quantised from its remaining tokens: exactly from their original values when the cut stays
        inside the open block (speculative decoding's rejected tokens), otherwise from their dequantised values (a
        full block's originals are not kept)."""
        if not self.is_initialized:
            return
        n = self.length
        keep = (tokens_to_remove if tokens_to_remove < n else n) if tokens_to_remove > 0 else n + tokens_to_remove
        keep = max(0, keep)
        if keep >= n:
            return
        start = (keep // ref.BLOCK) * ref.BLOCK
        if start == (n // ref.BLOCK) * ref.BLOCK:  # inside the open block: the originals are in the tail
            k_open, v_open = self.k_tail[:, :, :keep - start], self.v_tail[:, :, :keep - start]
        else:
            nb = ref.n_blocks(keep)
            k_open = ref.dequantize(self.k_data[:, :, start:keep], self.k_scale[:, :, start // ref.BLOCK:nb],
                                    self.k_shift)
            v_open = ref.dequantize(self.v_data[:, :, start:keep], self.v_scale[:, :, start // ref.BLOCK:nb])
        self.length = start
        self._write_open(k_open, v_open)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._index_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._index_batch(lambda t: t[indices, ...])


class Fp8StaticLayer(_Fp8Storage, StaticLayer):
    """A ``StaticLayer`` whose K/V are FP8: storage for ``max_cache_len`` tokens allocated once, written in place,
    with no crop. Unlike ``StaticLayer`` it returns (and sizes the mask for) the written tokens only: transformers
    keeps a one-token query's mask only for a compileable cache, and this one is not, so a decode step given the
    whole capacity attended to the unused slots (whatever a rewound run left there). The exceptions are the
    ``device_position`` steps (module docstring): placeholders of the capacity that llm_attn's decode kernel bounds
    by the used length on the device, and stock attention's copy of the capacity while a CUDA graph is captured,
    when transformers builds the mask."""

    is_compileable = False  # the write position is a host int (the open block's place): not traceable yet

    def __init__(self, max_cache_len: int, device_position: bool = False, **kwargs):
        super().__init__(max_cache_len=max_cache_len, **kwargs)
        self.device_position = device_position
        self._on_device = False  # the device-side state (cumulative_length, the open buffers) is ahead of the host's

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # device_position writes whole 64-token blocks: the storage rounds the capacity up to a block
        capacity = ref.n_blocks(self.max_cache_len) * ref.BLOCK if self.device_position else self.max_cache_len
        self._init_storage(key_states, value_states, capacity=capacity)
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim = self.v_head_dim = key_states.shape[-1]
        self.cumulative_length = self.cumulative_length.to(self.device)
        if self.device_position:
            b, h, d = self.batch_size, self.num_heads, self.k_head_dim
            self._k_open = torch.zeros((b, h, ref.BLOCK, d), dtype=torch.float32, device=self.device)
            self._v_open = torch.zeros_like(self._k_open)
            self._slots = torch.arange(ref.BLOCK, device=self.device)
            self._used = torch.zeros((b,), dtype=torch.int32, device=self.device)
            self._append_kernel = None  # decided at the first device step (the build, the dtype)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[2]
        if self._device_step(new):
            return self._update_on_device(key_states, value_states)
        self._sync_position()
        if self.length + new > self.max_cache_len:
            raise IndexError(f"Fp8StaticCache holds {self.max_cache_len} tokens: {self.length} cached + {new} new "
                             f"do not fit")
        self._write_open(*self._open_tokens(key_states, value_states))
        self.cumulative_length.add_(new)
        return self._dequantized()

    # -- device_position: the decode step on the device alone -----------------------------------------------------
    def _device_step(self, query_length: int) -> bool:
        # Not while torch.compile traces: the step's used-length read (one sync) and its append launch cannot be
        # traced; the host path's ops can, and store the same bytes.
        return (self.device_position and self.is_initialized and query_length == 1
                and not torch.compiler.is_compiling())

    def _update_on_device(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """One token written and its block re-quantised with no host value (module docstring): the host path's
        arithmetic (``_write_open``, ``kv_cache_reference.quantize``), on the 64-slot block with the slots past the
        token masked."""
        if not self._on_device:
            if _capturing():  # the refill would be captured and replayed over every later step's block
                raise RuntimeError("Fp8StaticCache(device_position=True): the first device step after a host-side "
                                   "update cannot be captured in a CUDA graph; run one decode step eagerly (or "
                                   "restore_position) before the capture")
            self._load_open_block()
        if self._use_append_kernel(key_states, value_states):
            # The same arithmetic in one launch (kernels/fp8_cache_append.h): bit-identical bytes, scales and shift.
            self.k_shift = self.k_shift.contiguous()
            ops.fp8_cache_append(key_states, value_states, self._k_open, self._v_open, self.k_shift, self.k_data,
                                 self.v_data, self.k_scale, self.v_scale, self.cumulative_length, self._used,
                                 self.max_cache_len)
            self.cumulative_length.add_(1)
            return self._device_result(self._used)
        last_block = ref.n_blocks(self.max_cache_len) - 1
        pos = self.cumulative_length
        slot = (pos % ref.BLOCK).view(1)
        block = torch.clamp(pos // ref.BLOCK, max=last_block)
        self._k_open.index_copy_(2, slot, key_states.to(torch.float32))
        self._v_open.index_copy_(2, slot, value_states.to(torch.float32))
        valid = (self._slots <= slot).view(1, 1, ref.BLOCK, 1)
        median = torch.where(valid, self._k_open, float("nan")).nanmedian(dim=2).values  # as smoothing_shift
        self.k_shift.copy_(torch.where(block == 0, median, self.k_shift))  # block 0 open: K's shift follows it
        rows = block * ref.BLOCK + self._slots
        for x, data, scale in ((self._k_open - self.k_shift.unsqueeze(2), self.k_data, self.k_scale),
                               (self._v_open, self.v_data, self.v_scale)):
            q, sc = ref.quantize(torch.where(valid, x, 0.0))  # zeros past the token never raise the block's amax
            data.view(torch.uint8).index_copy_(2, rows, q.view(torch.uint8))  # no float8 index_copy on CPU
            scale.index_copy_(2, block.view(1), sc)
        self.cumulative_length.add_(1)
        used = torch.clamp(self.cumulative_length, max=self.max_cache_len).to(torch.int32)
        used = used.view(1).expand(self.k_data.shape[0]).contiguous()
        return self._device_result(used)

    def _device_result(self, used: torch.Tensor):
        """What a device step returns. llm_attn's attention: placeholders of the whole capacity, the used length on
        the device. Stock attention (it reads a copy): while a CUDA graph is captured, the copy of the whole
        capacity, whose slots past the used length transformers' causal mask hides (it builds the mask whenever a
        graph is captured, as for its own StaticCache); otherwise the copy of the used tokens, their number read
        back (one sync, as the host path's), so an eager step returns exactly what the host path returns."""
        view = self._fp8_view(self.max_cache_len, used)
        if self._attention_reads_fp8():
            return self._placeholders(self.max_cache_len, view)
        n = self.max_cache_len if _capturing() else self._device_length()
        k, v = ops.fp8_kv_dequantized(self._fp8_view(n), self.dtype)
        setattr(k, ref.FP8_KV_ATTR, view)
        setattr(v, ref.FP8_KV_ATTR, view)
        return k, v

    def _device_length(self) -> int:
        """The used length the device holds (one sync), checked against the capacity as the host read checks it."""
        n = int(self.cumulative_length.item())
        if n > self.max_cache_len:
            raise IndexError(f"Fp8StaticCache holds {self.max_cache_len} tokens: device-side decode steps went "
                             f"{n - self.max_cache_len} past it (those were not stored)")
        return n

    def _use_append_kernel(self, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
        """The one-launch append where the build has it (``ops.fp8_cache_append_available``), for the dtypes and
        head_dims it takes; otherwise the PyTorch ops below (CPU, an extension built before the kernel)."""
        if self._append_kernel is None:
            self._append_kernel = (self.k_data.is_cuda and self.k_data.shape[-1] in (64, 128)
                                   and self.cumulative_length.dtype == torch.int64
                                   and ops.fp8_cache_append_available())
        return (self._append_kernel and key_states.dtype in (torch.float16, torch.bfloat16)
                and value_states.dtype == key_states.dtype)

    def _load_open_block(self) -> None:
        """The open block's originals, from the host tail into the fixed buffers, in place: the device is ahead now."""
        for buf, tail in ((self._k_open, self.k_tail), (self._v_open, self.v_tail)):
            buf.zero_()
            buf[:, :, :tail.shape[2]] = tail
        self._on_device = True

    def _sync_position(self) -> None:
        """Bring the host's length and tail up to the device's (one sync), after device steps."""
        if not self._on_device:
            return
        n = self._device_length()
        t = n % ref.BLOCK
        self.k_tail, self.v_tail = self._k_open[:, :, :t].clone(), self._v_open[:, :, :t].clone()
        self.length = n
        self._on_device = False

    def fp8(self) -> ref.Fp8KV:
        self._sync_position()
        return super().fp8()

    def _index_batch(self, fn) -> None:  # beam search, offload: on the host's state (the next device step refills)
        self._sync_position()
        super()._index_batch(fn)

    def _store(self, start: int, full: int, kq, ks, vq, vs) -> None:
        self.k_data[:, :, start:start + kq.shape[2]] = kq
        self.v_data[:, :, start:start + vq.shape[2]] = vq
        self.k_scale[:, :, full:full + ks.shape[2]] = ks
        self.v_scale[:, :, full:full + vs.shape[2]] = vs

    def _returned_tokens(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self._device_step(query_length):  # what the device step will return (_device_result)
            if self._attention_reads_fp8() or _capturing():
                return self.max_cache_len, 0  # the capacity (the used length on the device, or transformers' mask)
            return self._device_length() + query_length, 0
        self._sync_position()
        cached = self.length if self.is_initialized else 0
        return cached + query_length, 0  # as DynamicLayer: what update will return

    def position_state(self) -> tuple:
        """What ``restore_position`` needs to bring the layer back to this point (as a static decode loop rewinds
        ``cumulative_length``): the host-side length, K's shift and the open block's float32 originals. The stored
        bytes need no copy: the next write re-quantises the open block from the tail, and slots past the length
        are masked."""
        self._sync_position()
        return self.length, self.k_shift.clone(), self.k_tail.clone(), self.v_tail.clone()

    def restore_position(self, state: tuple) -> None:
        """The caller restores ``cumulative_length`` (as for ``StaticLayer``). With ``device_position`` the open
        block's buffers are refilled in place, so a CUDA graph of device steps replays from here."""
        self.length, shift, k_tail, v_tail = state
        self.k_shift.copy_(shift)
        self.k_tail, self.v_tail = k_tail.clone(), v_tail.clone()
        self._on_device = False
        if self.device_position and self.is_initialized:
            self._load_open_block()

    def extend_by_repeating(self, context: int, chunk: int = 8192) -> None:
        """Fill positions ``length .. context`` with the cached tokens, repeated in order (their stored values,
        dequantised and quantised again through the host path, ``chunk`` tokens at a time), and move the position
        there: a cache that reads as ``context`` tokens long without a prefill that long (the harness's
        ``--context``; the tokens are not a continuation of anything)."""
        self._sync_position()
        n = self.length
        if not self.is_initialized or n == 0:
            raise ValueError("extend_by_repeating needs a prefilled layer")
        if not n <= context <= self.max_cache_len:
            raise ValueError(f"context {context} must be between the {n} cached tokens and the capacity "
                             f"{self.max_cache_len}")
        k, v = self.fp8().dequantized(torch.float32)
        for start in range(n, context, chunk):
            idx = torch.arange(start, min(start + chunk, context), device=k.device) % n
            self._write_open(*self._open_tokens(k[:, :, idx], v[:, :, idx]))
        self.cumulative_length.fill_(context)

    def reset(self) -> None:
        if self.is_initialized:
            for t in (self.k_data, self.v_data, self.k_shift):
                t.zero_()
            for t in (self.k_scale, self.v_scale):
                t.fill_(1.0)
            self.k_tail, self.v_tail = self.k_tail[:, :, :0], self.v_tail[:, :, :0]
            self.length = 0
            self._on_device = False
        self.cumulative_length.zero_()


def _full_attention_layers(config, what: str) -> int:
    layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    other = sorted(set(layer_types) - {"full_attention"})
    if other:
        raise ValueError(f"{what} supports models with full-attention layers only; this one has {other}")
    return len(layer_types)


class _Fp8CacheMixin:
    def _serve(self, config) -> None:
        """Give every layer the model's config: update asks it which attention function reads the layer."""
        for layer in self.layers:
            layer.attn_config = config

    def fp8(self, layer_idx: int) -> ref.Fp8KV:
        """Layer ``layer_idx``'s raw FP8 data and scales (``kv_cache_reference.Fp8KV``)."""
        return self.layers[layer_idx].fp8()


class Fp8DynamicCache(_Fp8CacheMixin, Cache):
    """A dynamic cache (grows with every token, as ``DynamicCache``) that stores K/V in FP8. With ``config`` one layer
    per decoder layer is made up front; without, layers are added as ``update`` meets them."""

    def __init__(self, config=None):
        if config is None:
            super().__init__(layer_class_to_replicate=Fp8DynamicLayer)
        else:
            n = _full_attention_layers(config, "Fp8DynamicCache")
            super().__init__(layers=[Fp8DynamicLayer() for _ in range(n)])
            self._serve(config)


class Fp8StaticCache(_Fp8CacheMixin, Cache):
    """A static cache of ``max_cache_len`` tokens per layer (as ``StaticCache``) that stores K/V in FP8.
    ``device_position``: one-token decode steps run on the device alone, capturable in a CUDA graph, for llm_attn's
    attention (which reads the bytes) and stock attention (which reads a copy) alike (module docstring)."""

    def __init__(self, config, max_cache_len: int, device_position: bool = False):
        n = _full_attention_layers(config, "Fp8StaticCache")
        super().__init__(layers=[Fp8StaticLayer(max_cache_len=max_cache_len, device_position=device_position)
                                 for _ in range(n)])
        self._serve(config)
