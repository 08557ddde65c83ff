"""Projections, embeddings and MLPs: `DenseGeneral` (with LoRA's adapters
when its parameters hold them), the kernel initialisers, the token
embedding `Embed` (also the tied output layer), the untied `OutputDense`,
and `Mlp` with its activations (Hugging Face's and t5x's names).
"""

import functools
import operator
from typing import Any, Callable, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxrlhf import checks
from jaxrlhf.models.layers import param_recording

Array = jax.Array


# ----------------------------------------------------------------------------
# Initialisers.

def kernel_init(num_in_axes: int, num_out_axes: int):
  """LeCun-normal (truncated) with fan-in over all leading input axes, for a
  kernel [*in_axes, *out_axes]."""
  return nn.initializers.variance_scaling(
      1.0, "fan_in", "truncated_normal",
      in_axis=tuple(range(num_in_axes)),
      out_axis=tuple(range(num_in_axes, num_in_axes + num_out_axes)))


def default_embedding_init():
  # Std 1/sqrt(embed): tied output logits h @ E^T of a normalised h are O(1).
  return nn.initializers.variance_scaling(1.0, "fan_in", "normal",
                                          in_axis=1, out_axis=0)


def _boxed(init, names):
  return nn.with_logical_partitioning(init, names)


class DenseGeneral(nn.Module):
  """y = x . kernel over the last `num_in_axes` axes of x, plus a bias.

  The kernel [*in_shape, *features] is created at its full shape with its
  logical names (flax's DenseGeneral initialises a flattened 2-D kernel and
  reshapes it, which fails under a mesh with logical rules active, because
  the 2-D value is constrained with the multi-axis names).

  LoRA (`jaxrlhf.models.lora`): when the parameters given to `apply` hold
  `lora_a` [*in_shape, r] and `lora_b` [r, *features] beside the kernel
  (the adapters' view of a frozen base, B already times alpha / r), the
  output is x . kernel + (x . lora_a) . lora_b; without them it is the
  base alone. `lora_dropout_key` (uint32 [2]) and `lora_dropout_rate`
  (float32 []), present only in training, drop x's entries on the
  adapters' path alone.
  """
  features: Sequence[int]
  kernel_axes: Sequence[str]
  num_in_axes: int = 1
  use_bias: bool = False
  dtype: Any = jnp.float32
  # None: LeCun-normal (truncated) over the input axes (`kernel_init`).
  kernel_init: Optional[Callable] = None

  @nn.compact
  def __call__(self, x: Array) -> Array:
    features = tuple(self.features)
    n_in = self.num_in_axes
    init = self.kernel_init or kernel_init(n_in, len(features))
    kernel = self.param(
        "kernel", _boxed(init, tuple(self.kernel_axes)),
        x.shape[x.ndim - n_in:] + features, jnp.float32)
    contract = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
    y = jax.lax.dot_general(x.astype(self.dtype), kernel.astype(self.dtype),
                            (contract, ((), ())))
    if self.has_variable("params", "lora_a"):
      y = y + self._lora(x, contract)
    if self.use_bias:
      bias = self.param(
          "bias", _boxed(nn.initializers.zeros,
                         tuple(self.kernel_axes[n_in:])),
          features, jnp.float32)
      y = y + bias.astype(self.dtype)
    return y

  def _lora(self, x: Array, contract) -> Array:
    """(x . lora_a) . lora_b: the adapters' low-rank update (class doc)."""
    lora_a = self.get_variable("params", "lora_a").astype(self.dtype)
    lora_b = self.get_variable("params", "lora_b").astype(self.dtype)
    if self.has_variable("params", "lora_dropout_key"):
      rate = self.get_variable("params", "lora_dropout_rate")
      keep = jax.random.bernoulli(
          self.get_variable("params", "lora_dropout_key"), 1.0 - rate,
          x.shape)
      x = jnp.where(keep, x / (1.0 - rate).astype(x.dtype),
                    jnp.zeros((), x.dtype))
    h = jax.lax.dot_general(x.astype(self.dtype), lora_a,
                            (contract, ((), ())))
    return jax.lax.dot_general(h, lora_b, (((h.ndim - 1,), (0,)), ((), ())))

  def param_read_dtypes(self, method: str):
    """{parameter: the dtype `method` casts it to at every read}
    (`recording_param_reads`). The LoRA factors are read cast too but are
    left out: a fraction of a percent of the weights, casting them once
    saves nothing, and it cost the LoRA GRPO plans' sampling 0.5 GiB of
    XLA's temporaries (experiments/results/plans)."""
    return {"kernel": self.dtype, "bias": self.dtype} if method == "__call__" \
        else {}


# ----------------------------------------------------------------------------
# MLP.

def _gelu_exact(x):
  return nn.gelu(x, approximate=False)


# Names follow Hugging Face's `hidden_act` strings where they differ: 'gelu'
# is the exact erf form (GPT-NeoX), 'gelu_new' the tanh approximation.
ACTIVATIONS = {
    "silu": nn.silu,
    "gelu": _gelu_exact,
    "gelu_new": functools.partial(nn.gelu, approximate=True),
    "gelu_pytorch_tanh": functools.partial(nn.gelu, approximate=True),
    "relu": nn.relu,
    "linear": lambda x: x,
}


# t5x's MLP activation names -> `ACTIVATIONS` (t5x's 'gelu' is the tanh
# approximation; ours, as Hugging Face's, is the exact erf form).
T5_ACTIVATIONS = {"gelu": "gelu_new", "relu": "relu", "linear": "linear",
                  "silu": "silu"}


def t5_mlp_activations(names: Sequence[str]) -> Tuple[str, ...]:
  """t5x activation names as `Mlp` activations."""
  for name in names:
    if name not in T5_ACTIVATIONS:
      raise ValueError(f"Unknown MLP activation {name!r}; choose from "
                       f"{sorted(T5_ACTIVATIONS)}.")
  return tuple(T5_ACTIVATIONS[n] for n in names)


class Mlp(nn.Module):
  """Product of activated input projections, then the output projection.

  ('silu', 'linear') is SwiGLU (wi_0 = gate, wi_1 = up, as t5x's gated MLP);
  a single activation gives the plain MLP with one input projection 'wi'.
  With `dropout_rate`, the hidden units are dropped (masks shared along
  length, as t5x) unless `deterministic`.
  """
  mlp_dim: int
  activations: Sequence[str]
  use_bias: bool = False
  dtype: Any = jnp.float32
  dropout_rate: float = 0.0

  @nn.compact
  def __call__(self, x: Array, deterministic: bool = True) -> Array:
    """x [batch, length, embed] -> [batch, length, embed]."""
    for name in self.activations:
      checks.check_choice("Mlp", "activation", name, ACTIVATIONS)
    if self.has_variable("params", param_recording.FUSED_WI):
      # The input projections stacked (`fuse_projections`).
      joined = DenseGeneral((len(self.activations), self.mlp_dim),
                            ("embed", None, "mlp"), use_bias=self.use_bias,
                            dtype=self.dtype, name=param_recording.FUSED_WI)(x)
      projected = [joined[..., i, :] for i in range(len(self.activations))]
    else:
      projected = [
          DenseGeneral((self.mlp_dim,), ("embed", "mlp"),
                       use_bias=self.use_bias, dtype=self.dtype, name=name)(x)
          for name in self._input_names()]
    hidden = [ACTIVATIONS[name](h)
              for name, h in zip(self.activations, projected)]
    h = functools.reduce(operator.mul, hidden)
    if self.dropout_rate:
      h = nn.Dropout(self.dropout_rate, broadcast_dims=(-2,))(
          h, deterministic=deterministic)
    h = nn.with_logical_constraint(h, ("batch", "length", "mlp"))
    return DenseGeneral((x.shape[-1],), ("mlp", "embed"),
                        use_bias=self.use_bias, dtype=self.dtype,
                        name="wo")(h)

  def _input_names(self) -> Tuple[str, ...]:
    if len(self.activations) == 1:
      return ("wi",)
    return tuple(f"wi_{i}" for i in range(len(self.activations)))

  def param_fusions(self, method: str):
    """The projections `fuse_projections` may join
    (`recording_param_fusions`): the gated MLP's input projections."""
    if method != "__call__" or len(self.activations) == 1:
      return ()
    return (param_recording.Fusion(param_recording.FUSED_WI,
                                   self._input_names(), stack=True,
                                   unsplit=("mlp",)),)


# ----------------------------------------------------------------------------
# Embedding and output layer.

class Embed(nn.Module):
  """Token embedding [vocab, embed]; `attend` uses it as a tied output layer."""
  num_embeddings: int
  features: int
  dtype: Any = jnp.float32
  # None: normal with std 1/sqrt(embed) (`default_embedding_init`).
  embedding_init: Optional[Callable] = None
  # The dtype of `attend`'s product (None: `dtype`); t5x computes tied
  # logits in float32.
  attend_dtype: Any = None

  def setup(self):
    self.embedding = self.param(
        "embedding", _boxed(self.embedding_init or default_embedding_init(),
                            ("vocab", "embed")),
        (self.num_embeddings, self.features), jnp.float32)

  def __call__(self, tokens: Array) -> Array:
    """tokens [batch, length] -> [batch, length, embed] in `dtype`."""
    return jnp.take(self.embedding, tokens, axis=0).astype(self.dtype)

  def attend(self, x: Array) -> Array:
    """x [batch, length, embed] -> logits [batch, length, vocab]."""
    dtype = self.attend_dtype or self.dtype
    return jnp.einsum("ble,ve->blv", x.astype(dtype),
                      self.embedding.astype(dtype))

  def param_read_dtypes(self, method: str):
    """{parameter: the dtype `method` casts it to at every read}
    (`recording_param_reads`)."""
    if method == "__call__":
      return {"embedding": self.dtype}
    if method == "attend":
      return {"embedding": self.attend_dtype or self.dtype}
    return {}


class OutputDense(nn.Module):
  """Untied output layer: kernel [embed, vocab], no bias."""
  vocab_size: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    kernel = self.param("kernel", _boxed(kernel_init(1, 1), ("embed", "vocab")),
                        (x.shape[-1], self.vocab_size), jnp.float32)
    return jnp.einsum("ble,ev->blv", x.astype(self.dtype),
                      kernel.astype(self.dtype))

  def param_read_dtypes(self, method: str):
    """{parameter: the dtype `method` casts it to at every read}
    (`recording_param_reads`)."""
    return {"kernel": self.dtype} if method == "__call__" else {}
