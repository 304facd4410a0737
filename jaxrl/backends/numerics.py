"""The numerics value: every backend form the programs use, chosen once per platform.

A `Numerics` is chosen from the platform the programs run on (`numerics_of` a mesh: its
devices', which for `jaxrl plan --topology` are a TPU slice compiled for from a CPU host) and
passed into the jitted programs as a static argument, as `ModelSpec` is. Nothing in `model/`,
`quant/`, `sampling/`, `rl/` or `lora/` reads the backend; they call the methods here. What it
decides:

  products     x @ W of the dense weights: the plain einsum with float32 sums (GPUs, TPUs,
               float32 anywhere), or on the CPU for operands below float32 the float32-result
               product with a hand-written backward (`jaxrl.backends.cpu`).
  NF4 forms    which `jaxrl.quant.qmatmul` form a quantized linear takes, for calls with one
               token per row (decode: bound by reading the kernel) and with many.
  holding      how the stacked layer weights are held: as arrays, or on the CPU each bfloat16
               array as its bits (`jaxrl.backends.cpu.Bits`), from load on (`hold`).
  cache        the KV cache's dtype: the activations' (lossless: keys and values are computed in
               it), or float32 on the CPU, where a bfloat16 cache is converted whole for each
               decode step's write.
  head         the LM head's layout in a decode step: plain, or vocab-major on one CPU device.
  saves        what remat "dots" saves of a projection: the value as computed, or on the CPU a
               bfloat16 projection as its exact float32 value (XLA:CPU updates a float32 stack
               of saved values in place, a bfloat16 one by converting the whole stack).
  attention    a decode step's attention: over every cache column, masked (the XLA form);
               over blocks of columns up to the fullest live row in a device loop (the CPU's:
               `jaxrl.backends.attention_blocks`); or the GPU kernel that reads each row's
               filled columns.
  compiler     the XLA options of the decode program (on the CPU a memory-ordered schedule).
  chunk end    a server's early-stopping decode chunk (the CPU's; GPUs and TPUs run fixed
               chunks with no host transfer) also ends at its next step once the host asks
               (`interrupt_chunks`: a request was cancelled or arrived), so a freed slot or a
               new request waits one decode step, not the rest of a chunk; and a partial
               rollout's chunks are long ones that end once a group's slots are free, where the
               fixed chunks are short (`refill_chunk`).

A new backend form (a Pallas kernel, another layout) goes here: a field naming the choice, the
choice made in `numerics_for`, and the method the model calls; the kernel itself lives beside
its XLA reference, and the CPU can run each choice (`numerics_for("gpu")` on a CPU host) for
tests. Figures behind each CPU choice are in docs/benchmarks.md.
"""
from __future__ import annotations

import dataclasses
import functools
import threading
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import io_callback

from jaxrl.backends import cpu
from jaxrl.lora.lora import scaled_xa
from jaxrl.quant.nf4 import QTensor
from jaxrl.quant.qmatmul import FORMS, qmatmul

PLATFORMS = ("cpu", "gpu", "tpu")
# NF4 linear forms: jaxrl.quant.qmatmul's XLA forms, or "kernel", the Pallas GPU kernel that
# reads one layer of the stacked codes in place and adds the LoRA term in its epilogue
# (jaxrl/backends/nf4_gpu.py)
NF4_FORMS = FORMS + ("kernel",)
# decode attention: "xla" scores every cache column and masks (jaxrl.model.attention);
# "xla_blocks", a device loop over blocks of columns up to the batch's fullest row
# (jaxrl/backends/attention_blocks.py); or "pallas_gpu", the kernel that reads each row's
# filled columns of one layer of the stacked cache in place (jaxrl/backends/attention_gpu.py)
ATTENTION_FORMS = ("xla", "xla_blocks", "pallas_gpu")


class AtLayer:
    """Layer `layer` (a traced int32 scalar) of `stack`, a pytree of arrays or QTensors with a
    leading [L] axis, not sliced: a kernel reads it in place, where a slice that feeds a
    custom call is copied by XLA:GPU; an XLA form takes the slice (`get`)."""

    __slots__ = ("stack", "layer")

    def __init__(self, stack, layer):
        self.stack, self.layer = stack, layer

    def get(self):
        """The layer's slice of every leaf."""
        return jax.tree_util.tree_map(
            lambda a: jax.lax.dynamic_index_in_dim(a, self.layer, keepdims=False), self.stack)


_interrupt = threading.Event()


def interrupt_chunks() -> None:
    """Ask the early-stopping decode chunk in flight (any engine's, this process) to end at its
    next step (callable from any thread; `Numerics.chunk_interrupted`)."""
    _interrupt.set()


def chunk_begins() -> None:
    """An engine step begins: what was asked before it is its to serve."""
    _interrupt.clear()


@dataclasses.dataclass(frozen=True)
class Numerics:
    """The backend forms of one platform (module docstring). Hashable: a static argument."""

    name: str  # the platform chosen for (cpu, gpu, tpu) or "xla" (the reference)
    cpu_products: bool = False  # operands below float32 take `cpu.product`
    nf4_decode: str = "block"  # NF4 form of a call with one token per row (NF4_FORMS)
    nf4_many: str = "dense"  # NF4 form of a call with many tokens per row (NF4_FORMS)
    hold_bits: bool = False  # bfloat16 layer weights held as `cpu.Bits`
    float32_cache: bool = False  # KV cache in float32 (else the activations' dtype)
    vocab_major_head: bool = False  # a decode step's tied head vocab-major (one CPU device)
    float32_saves: bool = False  # remat dots saves low-precision projections as float32
    gather_bits: bool = False  # bfloat16 embedding rows gathered as bits
    decode_options: tuple[tuple[str, str], ...] = ()  # XLA options of the decode program
    dequantize_auto: str = "per_layer"  # quant.dequantize: auto -> once | per_layer
    attention: str = "xla"  # decode attention (ATTENTION_FORMS)
    fixed_chunk: bool = False  # a decode chunk: fixed trip count over live masks, no conds
    # a served prompt's prefill piece in tokens (`jaxrl serve --prefill-chunk` by default): a
    # piece in flight delays the running requests' next step by its time, which on the CPU is
    # about a decode step's at 128 tokens (docs/benchmarks.md, "Freeing slots")
    prefill_piece: int = 512
    # decode steps between refills of a partial rollout's slots (jaxrl/rl/partial.py): short
    # fixed chunks, or on the CPU long ones that end early once a group's slots are free
    refill_chunk: int = 2
    interpret: bool = False  # Pallas kernels in interpret mode (the GPU choice on a CPU host)

    def __post_init__(self):
        for form in (self.nf4_decode, self.nf4_many):
            if form not in NF4_FORMS:
                raise ValueError(f"NF4 form {form!r} is not one of {NF4_FORMS}")
        if self.attention not in ATTENTION_FORMS:
            raise ValueError(f"attention {self.attention!r} is not one of {ATTENTION_FORMS}")

    def chunk_interrupted(self) -> jax.Array:
        """Inside the early-stopping decode chunk (not `fixed_chunk`): whether the host has
        called `interrupt_chunks` since the engine's step began (a scalar bool, polled from
        the host at each step)."""
        return io_callback(lambda: np.bool_(_interrupt.is_set()), jax.ShapeDtypeStruct((), bool))

    @property
    def in_place_layers(self) -> bool:
        """Whether the layer loop hands the kernels whole stacks and the layer index
        (`AtLayer`: NF4 kernels and the KV cache) instead of scanning over their slices."""
        return self.attention == "pallas_gpu" or "kernel" in (self.nf4_decode, self.nf4_many)

    def nf4_form(self, tokens: int) -> str:
        """The NF4 form of a call with `tokens` tokens per row."""
        return self.nf4_decode if tokens == 1 else self.nf4_many

    # -- products ---------------------------------------------------------------------------
    def product(self, x: jax.Array, w: jax.Array, *, transposed: bool = False,
                dtype=jnp.float32) -> jax.Array:
        """x [..., I] @ w ([I, O], or [O, I] when transposed) -> [..., O], summed in float32
        and rounded to `dtype`; w is taken in x's dtype."""
        w = w.astype(x.dtype)
        if self.cpu_products and jnp.dtype(x.dtype).itemsize < 4:
            return cpu.product(x, w, transposed).astype(dtype)
        spec = "...i,oi->...o" if transposed else "...i,io->...o"
        return jnp.einsum(spec, x, w, preferred_element_type=dtype)

    def matmul(self, x: jax.Array, kernel, *, dtype) -> jax.Array:
        """x [..., T, I] @ kernel [I, O] (an array, `cpu.Bits`, an NF4 `QTensor`, or an
        `AtLayer` of a stacked one) as [..., T, O] in `dtype`, accumulated in float32; a
        QTensor takes the decode form when T is 1 and the many-token form otherwise."""
        form = self.nf4_form(x.shape[-2])
        if isinstance(kernel, AtLayer):
            if form == "kernel":
                return self.nf4_linear(x, kernel, None, dtype=dtype)
            kernel = kernel.get()
        if isinstance(kernel, QTensor):
            return qmatmul(x, kernel, form="split" if form == "kernel" else form, dtype=dtype)
        return self.product(x, dense(kernel), dtype=dtype)

    def fuses(self, kernel, tokens: int) -> bool:
        """Whether a linear of `kernel` over `tokens` tokens per row runs as one kernel with
        its LoRA term (and a gate|up pair with SwiGLU) in the epilogue (`nf4_linear`)."""
        return isinstance(kernel, AtLayer) and self.nf4_form(tokens) == "kernel"

    def nf4_linear(self, x: jax.Array, kernel: AtLayer, adapter, *, scale: float = 1.0,
                   dtype=None, up: AtLayer | None = None, up_adapter=None) -> jax.Array:
        """The Pallas NF4 kernel (jaxrl/backends/nf4_gpu.py) on x [..., I] and layer
        kernel.layer of the stacked QTensor kernel.stack, with adapter {"a": [I, r],
        "b": [r, O]} (or None) added in its epilogue: x @ W + scale * (x @ A) @ B, the
        low-rank product rounded as `jaxrl.lora.lora.lora_delta` rounds it. With `up` (and
        up_adapter): swiglu(gate, up) of the gate projection `kernel` and the up projection,
        in one kernel; an adapter may carry its x @ A term already ({"xa", "b"}, from
        `jaxrl.lora.lora.scaled_xa` of joined A matrices, `hold_adapters`). Differentiable
        (the backward is the XLA reference's)."""
        from jaxrl.backends import nf4_gpu

        lead, n_in = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, n_in)

        def low_rank(ad):
            if ad is None:
                return None
            if "xa" in ad:  # computed with other adapters' (joined A)
                return ad["xa"].reshape(-1, ad["xa"].shape[-1]), ad["b"].astype(x.dtype)
            return scaled_xa(x2, ad["a"], scale), ad["b"].astype(x.dtype)

        if up is None:
            y = nf4_gpu.nf4_matmul(x2, kernel.stack, kernel.layer, lora=low_rank(adapter),
                                   dtype=dtype or x.dtype, interpret=self.interpret)
        else:
            y = nf4_gpu.nf4_swiglu(x2, kernel.stack, up.stack, kernel.layer,
                                   gate_lora=low_rank(adapter), up_lora=low_rank(up_adapter),
                                   interpret=self.interpret)
        return y.reshape(*lead, y.shape[-1])

    def low_precision_saves(self, dtype) -> bool:
        """Whether remat saves a `dtype` projection as float32 (`save`)."""
        return self.float32_saves and jnp.dtype(dtype).itemsize < 4

    def save(self, y: jax.Array, name: str) -> jax.Array:
        """y named `name` for remat policies (jax.ad_checkpoint.checkpoint_name), saved as
        the numerics saves it (module docstring: saves)."""
        if self.low_precision_saves(y.dtype):
            return checkpoint_name(y.astype(jnp.float32), name).astype(y.dtype)
        return checkpoint_name(y, name)

    def filled_attention(self):
        """The decode attention that reads only filled cache columns of one layer of the
        layer-stacked cache (the `jaxrl.backends.attention_gpu.decode_attention` contract): the
        GPU kernel, or the XLA loop over blocks up to the fullest row; or None: the XLA form
        over every column (`jaxrl.model.attention.attend`)."""
        if self.attention == "pallas_gpu":
            from jaxrl.backends import attention_gpu
            return functools.partial(attention_gpu.decode_attention, interpret=self.interpret)
        if self.attention == "xla_blocks":
            from jaxrl.backends.attention_blocks import blocked_decode_attention
            return blocked_decode_attention
        return None

    # -- embedding and head -----------------------------------------------------------------
    def embed(self, table: jax.Array, tokens: jax.Array) -> jax.Array:
        """Rows of the table [V, E] for tokens [...]."""
        if self.gather_bits and table.dtype == jnp.bfloat16:
            return cpu.embed(table, tokens)
        return table[tokens]

    def tied_decode_logits(self, table: jax.Array, h: jax.Array) -> jax.Array | None:
        """A decode step's logits [S, V] float32 of h [S, E] against the tied table [V, E] on
        one device, when this numerics has a form of its own for them; None: the plain head."""
        return cpu.vocab_major_logits(table, h) if self.vocab_major_head else None

    # -- how weights and caches are held ----------------------------------------------------
    def hold(self, params: dict[str, Any]) -> dict[str, Any]:
        """params with the stacked layers as this numerics holds them (module docstring:
        holding); concrete or abstract (ShapeDtypeStructs) alike, and held params unchanged.
        Do it once where a run loads its weights: inside a program it copies the stack."""
        if not self.hold_bits:
            return params
        return {**params, "layers": cpu.hold(params["layers"])}

    def hold_adapters(self, lora, dtype):
        """A `Lora` for a program that only runs the forward (sampling): its weights cast once
        to the compute dtype (which each product casts them to anyway), layers held as `hold`
        holds the base's. Not differentiable where held as bits. None stays None."""
        if lora is None:
            return None
        weights = jax.tree_util.tree_map(lambda a: a.astype(dtype), lora.weights)
        layers = weights["layers"]
        if self.in_place_layers:  # the kernels' x @ A of a group of linears in one product
            layers = {**layers, **{joined_name(group): {
                "a": jnp.concatenate([layers[n]["a"] for n in group], axis=-1)}
                for group in JOINED if all(n in layers for n in group)}}
        layers = cpu.hold(layers) if self.hold_bits else layers
        return lora.replace(weights={**weights, "layers": layers})

    def cache_dtype(self, dtype):
        """The KV cache's dtype for activations in `dtype`."""
        return jnp.float32 if self.float32_cache else jnp.dtype(dtype)

    @property
    def lowering_platforms(self) -> tuple[str, ...] | None:
        """The platforms to lower this choice's programs for from any host: ("cuda",) where
        its Pallas GPU kernels run compiled (they lower for CUDA only), else None (the
        host's)."""
        return ("cuda",) if self.in_place_layers and not self.interpret else None

    def compiler_options(self, program: str) -> dict[str, str] | None:
        """XLA options for `program` ("decode"), or None."""
        return dict(self.decode_options) or None if program == "decode" else None

    def dequantize_strategy(self, quant, dense_fits=None) -> str:
        """"once" or "per_layer" for quant.dequantize; a named strategy is taken as it is.
        auto: "once" where this numerics always dequantizes once (dequantize_auto "once": the
        CPU, whose memory is plentiful and where dequantizing per layer dominates a step);
        elsewhere by memory: `dense_fits()` says whether the run fits the device's memory with
        its kernels dequantized once (True, False, or None when unknown; the planner's memory
        plan, `jaxrl.planner.dense_fit`), called only here, and auto is "once" when it does
        (dense kernels, plain matmuls), "per_layer" when it does not (NF4 kept), and
        dequantize_auto when that is unknown or dense_fits is None."""
        if quant.dequantize != "auto":
            return quant.dequantize
        if self.dequantize_auto == "once" or dense_fits is None:
            return self.dequantize_auto
        fits = dense_fits()
        if fits is None:
            return self.dequantize_auto
        return "once" if fits else "per_layer"


# Linears that read one input: where the kernels run them, a sampling program's adapters also
# hold the group's A matrices side by side under `joined_name(group)` (`hold_adapters`), so
# one product gives every member's x @ A.
JOINED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def joined_name(group) -> str:
    return "+".join(group)


def dense(x):
    """A held leaf (`cpu.Bits`) as its array; arrays as they are."""
    return x.as_dense() if isinstance(x, cpu.Bits) else x


def dense_tree(tree):
    """tree with every `cpu.Bits` leaf as its array (QTensors and arrays as they are)."""
    return jax.tree_util.tree_map(dense, tree, is_leaf=cpu.is_held)


# The XLA reference forms (the TPU's, and the default of functions called without a choice):
# plain products, the NF4 block form for one token per row and the dense form for many,
# weights as arrays, the cache in the activations' dtype.
REFERENCE = Numerics(name="xla")

# On few cores a decode step's weight copies and matmuls compete for memory under XLA:CPU's
# default (concurrency-optimized) schedule; ordered for memory it ran 1.5-1.7x faster on 2 cores
# (docs/benchmarks.md, "Where the rollout's time goes").
_CPU_DECODE_OPTIONS = (("xla_cpu_scheduler_type", "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"),)


def numerics_for(platform: str, devices: int = 1) -> Numerics:
    """The choice for programs on `devices` devices of `platform` (cpu, gpu or tpu)."""
    if platform == "cpu":
        return Numerics(name="cpu", cpu_products=True, hold_bits=True, float32_cache=True,
                        vocab_major_head=devices == 1, float32_saves=True, gather_bits=True,
                        decode_options=_CPU_DECODE_OPTIONS, dequantize_auto="once",
                        prefill_piece=128, refill_chunk=16, attention="xla_blocks")
    if platform == "gpu":
        # calls with many tokens: the split NF4 form, two elementwise-decoded half kernels that
        # XLA:GPU can fuse into their matmuls, where the block form's stacked levels and
        # float32 block sums went to memory on an H200 (docs/benchmarks.md, "First
        # accelerator check: one H200")
        xla = Numerics(name="gpu", nf4_decode="split", nf4_many="split", fixed_chunk=True)
        # the Pallas kernels on one device (a pallas_call has no partitioning rule, so on a
        # mesh they would gather their operands), where this jax lowers them
        if devices > 1 or gpu_kernels_unusable() is not None:
            return xla
        return dataclasses.replace(xla, nf4_decode="kernel", attention="pallas_gpu")
    if platform == "tpu":
        return dataclasses.replace(REFERENCE, name="tpu", fixed_chunk=True)
    raise ValueError(f"no numerics for platform {platform!r}; expected one of {PLATFORMS}")


@functools.lru_cache(maxsize=None)
def gpu_kernels_unusable() -> str | None:
    """None when this jax lowers the Pallas GPU kernels (jaxrl/backends/attention_gpu.py and
    nf4_gpu.py) for CUDA, else why not, in one line, warned once: the GPU choice then keeps the
    XLA forms. Probed by lowering each kernel at a tiny shape (no GPU needed)."""
    try:
        _lower_gpu_kernels()
    except Exception as err:  # any failure of this jax's Pallas: fall back, never crash
        why = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        warnings.warn(f"jax {jax.__version__} does not lower jaxrl's Pallas GPU kernels "
                      f"({why[:200]}); the GPU keeps the XLA forms", RuntimeWarning, 2)
        return why
    return None


def _lower_gpu_kernels() -> None:
    from jaxrl.backends import attention_gpu, nf4_gpu
    from jaxrl.quant.nf4 import quantize_np

    f32 = jnp.float32
    q = jax.ShapeDtypeStruct((1, 1, 16, 16), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((1, 1, 1, 64, 16), jnp.bfloat16)
    one = jax.ShapeDtypeStruct((1,), jnp.int32)
    layer = jax.ShapeDtypeStruct((), jnp.int32)
    w = quantize_np(np.zeros((1, 64, 32), np.float32), 64, "nf4")
    x = jax.ShapeDtypeStruct((2, 64), jnp.bfloat16)
    lora = (jax.ShapeDtypeStruct((2, 4), jnp.bfloat16), jax.ShapeDtypeStruct((4, 32), f32))

    def program(q, k, v, lengths, layer, x, lora):
        out, _ = attention_gpu.decode_attention(q, k, v, layer, lengths)
        return out, nf4_gpu.nf4_matmul(x, w, layer, lora=lora), nf4_gpu.nf4_swiglu(
            x, w, w, layer, gate_lora=lora, up_lora=lora)

    jax.jit(program).trace(q, cache, cache, one, layer, x, lora).lower(
        lowering_platforms=("cuda",))


def numerics_of(rules=None) -> Numerics:
    """The choice for programs on a mesh (`jaxrl.sharding.MeshRules`: its devices' platform
    and count), or on one device of the default backend when rules is None."""
    if rules is None:
        return numerics_for(jax.default_backend(), 1)
    devices = rules.mesh.devices
    return numerics_for(devices.flat[0].platform, devices.size)


class Program:
    """`fun` jitted with the XLA options its `numerics` argument asks for (`compiler_options`
    of `program`): one `jax.jit` per set of options, each called, or lowered, like the jitted
    function. `numerics` must be among `static_argnames`."""

    def __init__(self, fun, program: str, **jit_kwargs):
        if "numerics" not in jit_kwargs.get("static_argnames", ()):
            raise ValueError("a Program's numerics must be a static argument")
        self.fun, self.program, self._kwargs = fun, program, jit_kwargs
        self._jitted: dict[Any, Any] = {}

    def jitted(self, numerics: Numerics):
        options = numerics.compiler_options(self.program)
        key = None if options is None else tuple(sorted(options.items()))
        if key not in self._jitted:
            self._jitted[key] = jax.jit(self.fun, compiler_options=options, **self._kwargs)
        return self._jitted[key]

    def __call__(self, *args, numerics: Numerics = REFERENCE, **kwargs):
        return self.jitted(numerics)(*args, numerics=numerics, **kwargs)

    def lower(self, *args, numerics: Numerics = REFERENCE, lowering_platforms=None, **kwargs):
        """The lowered program; lowering_platforms (e.g. ("cuda",)) lowers for a platform
        this host lacks, as `jaxrl.bench.lowered` and the tests of the GPU choice do."""
        traced = self.jitted(numerics).trace(*args, numerics=numerics, **kwargs)
        return traced.lower(lowering_platforms=lowering_platforms)

    def cache_size(self) -> int:
        """Compiled programs held, over every set of options (as jax's `_cache_size`)."""
        return sum(f._cache_size() for f in self._jitted.values())
