"""Fast-path modules for mlx-lm's Qwen3.5/3.6 layers.

Each class subclasses the stock mlx-lm module and only replaces ``__call__``
with its op family's dispatch entry (:func:`ops.gated_delta.gated_delta_net`,
:func:`ops.moe.sparse_moe`), which decides per call what runs: the
parameters (quantised or not) stay the same arrays under the same paths, so
``model.parameters()``, saving, ``load_weights`` and sharding are unchanged.
:func:`rebind` moves an existing module instance to another class without
copying anything; :mod:`mlx_qwen_fast.patching` uses it in both directions.

The gated attention's class, :class:`FastAttention`, goes through
:func:`ops.attention.gated_attention`, which replaces only the attention of
a prefill chunk on CUDA; its one-token calls stay mlx-lm's, since the
decoder layer's step runs them.

Which route a decode token takes -- the whole layer stack as one compiled
call, each layer as one, each module's own dispatch entry, or stock -- is
decided in :mod:`ops.decoder` alone (:func:`ops.decoder.model_step`,
:func:`ops.decoder.layer_step`, reported by
:func:`ops.decoder.decode_routes`). The decoder layer's class is swapped in
place (``__class__``, the same object in ``model.layers``):
:class:`FastDecoderLayer` asks :func:`ops.decoder.layer_step` and runs every
call it declines as mlx-lm's layer. The layer stack (``Qwen3_5TextModel``)
is swapped the same way: :class:`FastTextModel` asks
:func:`ops.decoder.model_step`, then :func:`ops.verify.verify_step`. The
language-model head (``TextModel.lm_head``, a quantised linear) is swapped
the same way: :class:`FastHead` runs a call of 1 to 4 token rows through
:func:`ops.linear.decode_linear`.
"""

from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.qwen3_5 import DecoderLayer, GatedDeltaNet, Qwen3_5TextModel
from mlx_lm.models.qwen3_next import Qwen3NextAttention, Qwen3NextSparseMoeBlock

from . import backend, config, speculative
from .compiled import linear_arrays
from .ops import attention as attention_ops
from .ops import decoder as decoder_ops
from .ops import gated_delta as gated_delta_ops
from .ops import linear as linear_ops
from .ops import moe as moe_ops
from .ops import verify as verify_ops


def rebind(module: nn.Module, cls: type) -> nn.Module:
    """Return a module of class ``cls`` sharing every array and child of ``module``.

    ``cls`` must be ``type(module)``'s subclass or base class with the same
    attributes (the fast classes below and their stock parents).
    """
    new = cls.__new__(cls)
    dict.update(new, module)
    new.__dict__.update(module.__dict__)
    return new


class FastGatedDeltaNet(GatedDeltaNet):
    """``qwen3_5.GatedDeltaNet`` through :func:`ops.gated_delta.gated_delta_net`;
    on a :class:`mlx_qwen_fast.speculative.RollbackArraysCache` (inside a
    speculative loop) through :func:`mlx_qwen_fast.speculative.forward`,
    which records the states a trim puts back."""

    stock_class = GatedDeltaNet
    ops = gated_delta_ops  # the op family's dispatcher

    def __call__(self, inputs: mx.array, mask: Optional[mx.array] = None, cache: Optional[Any] = None) -> mx.array:
        if type(cache) is speculative.RollbackArraysCache:  # inside a speculative loop: record the steps
            return speculative.forward(self, inputs, mask, cache)
        return gated_delta_ops.gated_delta_net(self, inputs, mask, cache)


class FastSparseMoeBlock(Qwen3NextSparseMoeBlock):
    """Sparse MoE block (router, top-k experts, shared expert) via :func:`ops.moe.sparse_moe`."""

    stock_class = Qwen3NextSparseMoeBlock
    ops = moe_ops  # the op family's dispatcher

    def __call__(self, x):
        return moe_ops.sparse_moe(self, x)


class FastAttention(Qwen3NextAttention):
    """``qwen3_next.Qwen3NextAttention`` (qwen3_5's gated attention) through
    :func:`ops.attention.gated_attention`: on CUDA a prefill chunk's scaled
    dot-product attention runs the flash-attention kernel at head_dim 256
    (memory independent of the context) instead of MLX's; every other call
    -- one token (the decoder layer's step runs those), a mask array,
    quantised, rotating or batched caches, the CPU and Metal -- is mlx-lm's
    own ``__call__``."""

    stock_class = Qwen3NextAttention
    ops = attention_ops  # the op family's dispatcher

    def __call__(self, x: mx.array, mask: Optional[Any] = None, cache: Optional[Any] = None) -> mx.array:
        return attention_ops.gated_attention(self, x, mask, cache)


class FastDecoderLayer(DecoderLayer):
    """``qwen3_5.DecoderLayer`` whose call is :func:`ops.decoder.layer_step`
    (a one-token step as one compiled call, where that applies and
    :data:`mlx_qwen_fast.config.DECODE_LAYER_STEP` is on); every call it
    declines is mlx-lm's."""

    stock_class = DecoderLayer
    ops = decoder_ops

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache: Optional[Any] = None) -> mx.array:
        out = decoder_ops.layer_step(self, x, mask, cache)
        return DecoderLayer.__call__(self, x, mask, cache) if out is None else out


class FastTextModel(Qwen3_5TextModel):
    """``qwen3_5.Qwen3_5TextModel`` whose call is :func:`ops.decoder.model_step`
    (a one-token step with every layer in one compiled call, where that
    applies and :data:`mlx_qwen_fast.config.DECODE_MODEL_STEP` and
    :data:`~mlx_qwen_fast.config.DECODE_LAYER_STEP` are on), else
    :func:`ops.verify.verify_step` (the same for 2..16 tokens per row, a
    speculative verify, where that applies and
    :data:`~mlx_qwen_fast.config.VERIFY_MODEL_STEP` is on); every other call
    is mlx-lm's (its layers then take their own fast steps)."""

    stock_class = Qwen3_5TextModel
    ops = decoder_ops

    def __call__(self, inputs: mx.array, cache: Optional[Any] = None,
                 input_embeddings: Optional[mx.array] = None) -> mx.array:
        out = decoder_ops.model_step(self, inputs, cache, input_embeddings)
        if out is None:
            out = verify_ops.verify_step(self, inputs, cache, input_embeddings)
        return Qwen3_5TextModel.__call__(self, inputs, cache, input_embeddings) if out is None else out


class FastHead(nn.QuantizedLinear):
    """mlx-lm's language-model head (``TextModel.lm_head``, an
    ``nn.QuantizedLinear``) whose call on the rows of a decode step (1 to 4
    token rows) is :func:`ops.linear.decode_linear` where that runs its
    kernel (the fused quantised GEMV on CUDA: at the 248,320 x 2,048 4-bit
    head, 175 us against MLX's ``quantized_matmul`` 408 us on an H100,
    bench/results/INDEX.md, "Where the GPU time goes"); every other call
    (a prefill chunk, another backend, the switch off) is the module's own.
    Same rounding points as the module (one bf16 rounding of each output);
    the sums run in another order.

    The decision and the argument checks are made once per input shape,
    weight shapes and dtypes, backend and switch value, and kept on the
    module (one call per decode token runs here, outside the compiled step,
    so their Python would be paid per token); later calls with the same key
    go to :func:`ops.linear.decode_linear_unchecked`."""

    stock_class = nn.QuantizedLinear

    def __call__(self, x: mx.array) -> mx.array:
        if not isinstance(x, mx.array):
            return nn.QuantizedLinear.__call__(self, x)
        arrays, static = linear_arrays(self)
        # dtypes by name: the key is kept on the module, which copy.deepcopy must be able to copy
        key = (x.shape, str(x.dtype), static, tuple((a.shape, str(a.dtype)) for a in arrays), backend.current(),
               config.DECODE_GEMV_KERNEL.get())
        kept = self.__dict__.get("_mqf_head")
        if kept is None or kept[0] != key:
            kernel = linear_ops.decode_implementation(x, arrays, static) == "cuda-kernel"
            if kernel:
                linear_ops.decode_linear(x, arrays, static)  # its checks, once per key (the graph is dropped)
            kept = self.__dict__["_mqf_head"] = (key, kernel)
        if kept[1]:
            return linear_ops.decode_linear_unchecked(x, arrays, static, "cuda-kernel")
        return nn.QuantizedLinear.__call__(self, x)


#: stock head class -> fast class (swapped in place by ``__class__``); the
#: exact class only (a LoRA or sharded head keeps its own).
HEAD_CLASSES = {nn.QuantizedLinear: FastHead}

#: stock decoder-layer class -> fast class (swapped in place by ``__class__``).
LAYER_CLASSES = {DecoderLayer: FastDecoderLayer}

#: stock layer-stack class -> fast class (swapped in place by ``__class__``).
MODEL_CLASSES = {Qwen3_5TextModel: FastTextModel}

#: stock class -> fast class, for :mod:`mlx_qwen_fast.patching`.
FAST_CLASSES = {
    GatedDeltaNet: FastGatedDeltaNet,
    Qwen3NextSparseMoeBlock: FastSparseMoeBlock,
    Qwen3NextAttention: FastAttention,
}
