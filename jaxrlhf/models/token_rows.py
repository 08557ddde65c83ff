"""Exchanging two token ids in a model's parameters.

A tokenizer whose padding is not id 0 (Pythia: EOS 0, padding 1) is read
with ids 0 and P exchanged, so that seqio's padding id 0 is the padding and
the EOS is not (`jaxrlhf.data.hf_tokenizer`, PPO implementation-details
paper detail 3). A checkpoint trained with the tokenizer's own ids then
needs the same exchange of its token rows (the embedding and the output
layer, every parameter with a "vocab" logical axis) for every token to keep
its embedding and its logit; the exchange is its own inverse, so the same
call turns the parameters back before an export to Hugging Face.
"""

from typing import Optional, Tuple

import flax.linen as nn
import jax
import numpy as np

from jaxrlhf.models import registry


def swap_token_rows(module: nn.Module, params, ids: Optional[Tuple[int, int]]):
  """`params` of `module` with the entries of token ids `ids` = (a, b)
  exchanged along every "vocab" axis; `params` itself when `ids` is None.

  Args:
    module: the Flax module (its parameters' logical axis names say which
      axis is the vocabulary).
    params: its (unboxed) parameters, host or device arrays.
    ids: (a, b), e.g. `HFTokenizerVocabulary.token_swap`.
  """
  if ids is None:
    return params
  a, b = ids
  boxed = registry.abstract_params(module)
  names = jax.tree.map(
      lambda x: x.names if isinstance(x, nn.LogicallyPartitioned) else (),
      boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))

  def swap(x, axes):
    if "vocab" not in axes:
      return x
    axis = axes.index("vocab")
    if max(a, b) >= x.shape[axis]:
      raise ValueError(
          f"swap_token_rows: token ids {ids} need {max(a, b) + 1} rows, but "
          f"the parameter has {x.shape[axis]} along its vocabulary axis.")
    order = np.arange(x.shape[axis])
    order[[a, b]] = order[[b, a]]
    return x.take(order, axis=axis)

  return jax.tree.map(swap, params, names,
                      is_leaf=lambda x: isinstance(x, tuple))
