"""What the mixture-of-experts decoder families share: their config
(`MoeConfig`), their block (`MoeBlock`: Llama's layer whose MLP is
`layers.moe.MoeMlp` on the layers that have experts), their model
(`MoeCausalLM`), the router logits a forward pass records
(`router_logits`, `load_balancing_loss`) and the Hugging Face mapping of
their experts (`ExpertNames`, `tensor_shapes`, `from_hf`, `to_hf`).

A family (`qwen3_moe.py`, `mixtral.py`) subclasses the config with its
defaults, the block with its attention (`attention_options`), and names its
HF tensors; a third MoE family with Llama's layer needs no new block.

The router logits. Each layer with experts records its router's float32
logits [batch, length, experts] with Flax's `sow` in the collection
"intermediates" under the name "router_logits". A loss reads them by
applying the model with that collection mutable:

  logits, state = model.apply({"params": params}, tokens, positions,
                              attention_mask, mutable=["intermediates"])
  aux = moe_decoder.load_balancing_loss(config, state["intermediates"],
                                        attention_mask)
  loss = loss + config.router_aux_loss_coef * aux

(`router_logits(state["intermediates"])` stacks them [moe layers, batch,
length, experts], unrolled or scanned alike.) Applied without the
collection mutable (sampling, scoring) nothing is recorded.

In training that is done once for every algorithm: the gradient update
(`jaxrlhf.algorithms.update`) runs each loss inside `recording(params)`,
and the scoring adapters apply a MoE model through `apply`, which, for a
forward pass of parameters computed from the trained ones, records its
routing (`RouterRecord`); `router_loss` turns the records into the term the
loss adds and the `moe/...` metrics. Frozen networks (a reference, a
reward model, a teacher) and dense models record nothing.

Router replay (online RL's `online.router_replay`). A forward pass applied
with "intermediates" mutable also records the experts each token went to
(`routes`: int32 [batch, length, moe layers, top_k]); the sampler keeps
them for the tokens it feeds, and `apply(..., replayed=routes)` makes a
later forward pass of the same tokens route them alike
(`routing_variables`, read by `layers.moe.MoeMlp`).
"""

import contextlib
import dataclasses
import functools
import threading
import types
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.models import family
from jaxrlhf.models import llama
from jaxrlhf.models.layers import moe

Array = jax.Array

# The collection and name each MoE layer's router logits are sown under.
INTERMEDIATES = moe.INTERMEDIATES
ROUTER_LOGITS = "router_logits"


@dataclasses.dataclass(frozen=True)
class MoeConfig(family.LayerTypesConfig):
  """A `family.LayerTypesConfig` whose layers' MLPs are mixtures of
  experts (all, or those `decoder_sparse_step` and `mlp_only_layers`
  leave; the others keep a dense SwiGLU MLP of `mlp_dim`).

  Attributes (besides the shared ones):
    num_experts: experts per MoE layer.
    num_experts_per_tok: the k of each token's top-k experts.
    moe_mlp_dim: each expert's hidden width; None: mlp_dim (Mixtral's
      experts are `intermediate_size` wide).
    norm_topk_prob: the k routing weights renormalised to sum to 1 (else
      the softmax's probabilities over all experts).
    decoder_sparse_step: layer i has experts when (i + 1) is a multiple of
      it (and i is not in mlp_only_layers): Hugging Face's rule.
    mlp_only_layers: indices of layers with a dense MLP.
    router_aux_loss_coef: the load-balancing loss's weight in a training
      loss (`load_balancing_loss`); the model itself does not add it.
  """
  num_experts: int = 8
  num_experts_per_tok: int = 2
  moe_mlp_dim: Optional[int] = None
  norm_topk_prob: bool = True
  decoder_sparse_step: int = 1
  mlp_only_layers: Tuple[int, ...] = ()
  router_aux_loss_coef: float = 0.001

  _POSITIVE = family.LayerTypesConfig._POSITIVE + (
      "num_experts", "num_experts_per_tok", "decoder_sparse_step")

  def __post_init__(self):
    if isinstance(self.mlp_only_layers, list):  # as parsed from JSON
      object.__setattr__(self, "mlp_only_layers",
                         tuple(self.mlp_only_layers))
    super().__post_init__()

  @property
  def expert_mlp_dim(self) -> int:
    """Each expert's hidden width."""
    return self.mlp_dim if self.moe_mlp_dim is None else self.moe_mlp_dim

  @property
  def sparse_layers(self) -> Tuple[bool, ...]:
    """Whether each layer has experts (Hugging Face's rule)."""
    return tuple(i not in self.mlp_only_layers
                 and (i + 1) % self.decoder_sparse_step == 0
                 for i in range(self.num_layers))

  def mlps_differ(self) -> bool:
    """Some layers have experts and some a dense MLP."""
    return len(set(self.sparse_layers)) > 1

  def check(self) -> None:
    super().check()
    name = type(self).__name__
    if self.num_experts_per_tok > self.num_experts:
      raise ValueError(
          f"{name}: num_experts_per_tok={self.num_experts_per_tok} must be "
          f"at most num_experts={self.num_experts}.")
    if self.moe_mlp_dim is not None and (
        not isinstance(self.moe_mlp_dim, (int, np.integer))
        or self.moe_mlp_dim <= 0):
      raise ValueError(f"{name}.moe_mlp_dim must be a positive integer or "
                       f"None, got {self.moe_mlp_dim!r}.")
    bad = [i for i in self.mlp_only_layers
           if not isinstance(i, (int, np.integer))
           or not 0 <= i < self.num_layers]
    if bad:
      raise ValueError(f"{name}.mlp_only_layers: {bad} are not layer indices "
                       f"in [0, num_layers={self.num_layers}).")
    if self.scan_layers and self.mlps_differ():
      raise ValueError(
          f"{name}: scan_layers needs one layer body, but layers "
          f"{[i for i, s in enumerate(self.sparse_layers) if not s]} have a "
          "dense MLP and the others experts; set scan_layers=False, or "
          "decoder_sparse_step=1 and mlp_only_layers=().")


class MoeBlock(llama.LlamaBlock):
  """Llama's layer whose MLP, on the layers with experts, is `MoeMlp` (its
  router logits sown as `ROUTER_LOGITS`); a family subclasses it for its
  attention (`attention_options`)."""

  def feed_forward(self, h: Array, layer) -> Array:
    cfg = self.config
    sparse = cfg.sparse_layers
    # An int unrolled; None or traced only when every layer is alike
    # (`MoeConfig.check`, `MoeCausalLM.decoder_options`).
    if not sparse[layer if isinstance(layer, int) else 0]:
      return super().feed_forward(h, layer)
    y, logits = moe.MoeMlp(
        num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
        mlp_dim=cfg.expert_mlp_dim, norm_topk_prob=cfg.norm_topk_prob,
        dtype=jnp.dtype(cfg.dtype), name="mlp")(h)
    self.sow(INTERMEDIATES, ROUTER_LOGITS, logits)
    return y


class MoeCausalLM(llama.Llama):
  """A Llama-like causal LM with `MoeBlock`s; layers are indexed where
  their attention or their MLP differ."""
  config: MoeConfig
  block_cls = MoeBlock

  def decoder_options(self):
    cfg = self.config
    return {"index_layers": cfg.layers_differ() or cfg.mlps_differ()}


def _sown(intermediates, name: str) -> Array:
  """[moe layers, ...]: what each MoE layer sowed as `name` (in its block,
  or in its `mlp`) in the "intermediates" collection a forward pass
  returned, in layer order, from an unrolled (`layers_{i}`) or scanned
  (`layers`, already stacked) stack; of the model's first call where one
  apply called it more than once."""
  found = {}  # (path to the stack, layer index) -> [layers, ...]

  def visit(tree, path):
    for key, value in tree.items():
      if key == name:
        at = max(i for i, p in enumerate(path) if p.startswith("layers"))
        index = (int(path[at].rsplit("_", 1)[1])
                 if path[at].startswith("layers_") else -1)
        found[(path[:at], index)] = value[0] if index < 0 else value[0][None]
      elif hasattr(value, "items"):
        visit(value, path + (key,))
  visit(intermediates, ())
  if not found:
    raise ValueError(f"{name}: nothing was sown; apply the model with "
                     f"mutable=[{INTERMEDIATES!r}] (and a model with experts).")
  return jnp.concatenate([found[k] for k in sorted(found)], axis=0)


def router_logits(intermediates) -> Array:
  """float32 [moe layers, batch, length, experts]: the router logits a
  forward pass sowed (the "intermediates" collection it returned), in layer
  order (`_sown`)."""
  return _sown(intermediates, ROUTER_LOGITS).astype(jnp.float32)


# ----------------------------------------------------------------------------
# Router replay: the experts a forward pass chose, given to another.

def routes(intermediates) -> Array:
  """int32 [batch, length, moe layers, top_k]: the experts each token was
  routed to in a forward pass applied with "intermediates" mutable (the
  collection it returned), the MoE layers in order: the layout
  `routing_variables` replays."""
  return jnp.moveaxis(_sown(intermediates, moe.EXPERTS), 0, 2).astype(
      jnp.int32)


def route_shape(config: MoeConfig) -> Tuple[int, int]:
  """(moe layers, top_k): the trailing dimensions of a token's `routes`."""
  return sum(bool(s) for s in config.sparse_layers), config.num_experts_per_tok


def routing_variables(config: MoeConfig, replayed: Array):
  """The variable collection (`layers.moe.ROUTING`) that makes a forward
  pass of a `MoeCausalLM` of `config` route each token to the experts
  `replayed` int [batch, length, moe layers, top_k] holds (a token whose
  first entry is -1 routes itself), as `routes` returns them."""
  sparse = [i for i, s in enumerate(config.sparse_layers) if s]
  expected = route_shape(config)
  if replayed.ndim != 4 or tuple(replayed.shape[2:]) != expected:
    raise ValueError(f"routing_variables: the replayed routes have shape "
                     f"{tuple(replayed.shape)}, not [batch, length, moe "
                     f"layers, top_k] with {expected[0]} MoE layers and "
                     f"top_k {expected[1]}")
  if config.scan_layers:  # one layer body: every layer has experts
    return {"decoder": {"layers": {"mlp": {
        moe.EXPERTS: jnp.moveaxis(replayed, 2, 0)}}}}
  return {"decoder": {f"layers_{i}": {"mlp": {moe.EXPERTS: replayed[:, :, j]}}
                      for j, i in enumerate(sparse)}}


def load_balancing_loss(config: MoeConfig, intermediates,
                        attention_mask: Optional[Array] = None) -> Array:
  """transformers' auxiliary loss (`layers.moe.load_balancing_loss`) over
  every MoE layer's sown router logits, the tokens of `attention_mask`
  [batch, length] (1 = real) counted in each layer; unscaled (multiply by
  `config.router_aux_loss_coef`). float32 []."""
  logits = router_logits(intermediates)
  mask = None
  if attention_mask is not None:
    mask = jnp.broadcast_to(jnp.asarray(attention_mask), logits.shape[:-1])
  return moe.load_balancing_loss(logits, config.num_experts_per_tok,
                                 config.num_experts, mask)


# ----------------------------------------------------------------------------
# The router's loss in training: what a trained forward pass records.

class RouterRecord(NamedTuple):
  """The routing of one forward pass of trained parameters.

  Attributes:
    coef: its config's `router_aux_loss_coef`.
    aux: float32 [], the unscaled load-balancing loss of its counted tokens
      (`load_balancing_loss`).
    load: float32 [moe layers, experts], each layer's share of the counted
      tokens' routed slots per expert (`layers.moe.expert_load`; rows sum
      to 1).
  """
  coef: float
  aux: Array
  load: Array


# The innermost `recording`'s (trace ids of the trained parameters, its
# records), per thread: a loss is traced on the thread that calls it.
_RECORDING = threading.local()


@contextlib.contextmanager
def recording(trained):
  """Within it, `apply` records the routing of the forward passes whose
  parameters are computed from `trained` (the parameters a loss is
  differentiated by, as traced: `jax.value_and_grad`'s inputs; a LoRA
  view's merged weights count, a frozen network's closed-over weights do
  not). Yields the list the `RouterRecord`s are appended to."""
  traces = {id(x._trace) for x in jax.tree.leaves(trained)  # pylint: disable=protected-access
            if isinstance(x, jax.core.Tracer)}
  records: List[RouterRecord] = []
  stack = getattr(_RECORDING, "stack", None)
  if stack is None:
    stack = _RECORDING.stack = []
  stack.append((traces, records))
  try:
    yield records
  finally:
    stack.pop()


def _records_for(module, params) -> Optional[List[RouterRecord]]:
  """The list a forward pass of `module` with `params` records into: the
  innermost `recording`'s when the module has experts and the parameters
  are traced from that recording's trained ones; else None."""
  stack = getattr(_RECORDING, "stack", None)
  if not stack or not isinstance(module, MoeCausalLM):
    return None
  traces, records = stack[-1]
  trained = any(isinstance(x, jax.core.Tracer) and id(x._trace) in traces  # pylint: disable=protected-access
                for x in jax.tree.leaves(params))
  return records if trained else None


def apply(module, params, args, kwargs, attention_mask: Array, method=None,
          replayed: Optional[Array] = None):
  """`module.apply({"params": params}, *args, **kwargs, method=method)`,
  which within a `recording` of trained `params` of a model with experts
  also records its routing over the tokens of `attention_mask`
  [batch, length] (1 = counted); and which, given `replayed` routes
  (`routes`' layout) and a model with experts, routes as they say
  (`routing_variables`). Any other call is the plain apply."""
  variables = {"params": params}
  if replayed is not None and isinstance(module, MoeCausalLM):
    variables[moe.ROUTING] = routing_variables(module.config, replayed)
  records = _records_for(module, params)
  if records is None:
    return module.apply(variables, *args, **kwargs, method=method)
  out, state = module.apply(variables, *args, **kwargs,
                            method=method, mutable=[INTERMEDIATES])
  config = module.config
  inter = state[INTERMEDIATES]
  logits = router_logits(inter)                 # [layers, batch, length, e]
  mask = jnp.broadcast_to(jnp.asarray(attention_mask), logits.shape[:-1])
  load = jax.vmap(lambda x, m: moe.expert_load(
      x, config.num_experts_per_tok, m))(logits, mask)
  records.append(RouterRecord(
      coef=float(config.router_aux_loss_coef),
      aux=load_balancing_loss(config, inter, attention_mask),
      load=jax.lax.stop_gradient(load)))
  return out


# The metrics `router_loss` returns.
AUX_LOSS_METRIC = "moe/aux_loss"
LOAD_MAX_METRIC = "moe/expert_load/max"
LOAD_MIN_METRIC = "moe/expert_load/min"
LOAD_CV_METRIC = "moe/expert_load/cv"


def router_loss(records) -> Tuple[Array, Dict[str, Array]]:
  """(the term a trained loss adds, its metrics) from a loss's
  `RouterRecord`s (at least one): the mean over the records of coef x aux
  (one forward pass: transformers' `router_aux_loss_coef * aux_loss`), and

    moe/aux_loss          the mean unscaled aux (top_k when balanced),
    moe/expert_load/max   the busiest expert of any MoE layer, and
    moe/expert_load/min   the idlest, as its share of the layer's routed
                          slots times the experts (1 = an even share; 0 =
                          an expert no token reaches);
    moe/expert_load/cv    the layers' mean coefficient of variation of
                          their experts' loads (0 when even),

  each a mean over the records. float32 [] each.
  """
  if not records:
    raise ValueError("router_loss: no forward pass was recorded.")
  mean = lambda values: sum(values) / len(records)
  relative = [r.load * r.load.shape[-1] for r in records]  # 1 = even
  return mean([r.coef * r.aux for r in records]), {
      AUX_LOSS_METRIC: mean([r.aux for r in records]),
      LOAD_MAX_METRIC: mean([jnp.max(x) for x in relative]),
      LOAD_MIN_METRIC: mean([jnp.min(x) for x in relative]),
      LOAD_CV_METRIC: mean([jnp.mean(jnp.std(x, axis=-1)) for x in relative]),
  }


# ----------------------------------------------------------------------------
# Hugging Face: the experts' tensors.

@dataclasses.dataclass(frozen=True)
class ExpertNames:
  """How a family's checkpoints name a MoE layer's tensors under
  model.layers.{i}.: `block` (Qwen's "mlp", Mixtral's "block_sparse_moe"),
  its router `{block}.gate.weight` [experts, embed], and expert e's
  projections `{block}.experts.{e}.{gate|up|down}.weight` (torch Linear
  layouts: [mlp, embed], [mlp, embed], [embed, mlp]).

  That is the layout published checkpoints hold and transformers writes
  (5.x turns it into its fused in-memory tensors on load and back on save).
  The fused layout, `mlp.experts.gate_up_proj` [experts, 2 * mlp, embed]
  (gate rows first) and `mlp.experts.down_proj` [experts, embed, mlp], is
  read too where a file holds it.
  """
  block: str
  gate: str
  up: str
  down: str


_FUSED_GATE_UP = "mlp.experts.gate_up_proj"
_FUSED_DOWN = "mlp.experts.down_proj"


def _fused(tensors, prefix: str) -> bool:
  return prefix + _FUSED_GATE_UP in tensors


def _expert_shapes(cfg, names: ExpertNames, prefix: str, fused: bool):
  d, e, m = cfg.emb_dim, cfg.num_experts, cfg.expert_mlp_dim
  router = prefix + ("mlp" if fused else names.block) + ".gate.weight"
  shapes = {router: (e, d)}
  if fused:
    shapes[prefix + _FUSED_GATE_UP] = (e, 2 * m, d)
    shapes[prefix + _FUSED_DOWN] = (e, d, m)
    return shapes
  for i in range(e):
    base = f"{prefix}{names.block}.experts.{i}."
    shapes[base + names.gate + ".weight"] = (m, d)
    shapes[base + names.up + ".weight"] = (m, d)
    shapes[base + names.down + ".weight"] = (d, m)
  return shapes


def _experts_from(cfg, names: ExpertNames, t, prefix: str):
  linear, m = family.torch_linear, cfg.expert_mlp_dim
  if _fused(t, prefix):
    gate_up = t[prefix + _FUSED_GATE_UP]
    return {"router": {"kernel": linear(t[prefix + "mlp.gate.weight"])},
            "wi_0": linear(gate_up[:, :m]), "wi_1": linear(gate_up[:, m:]),
            "wo": linear(t[prefix + _FUSED_DOWN])}
  block = prefix + names.block

  def stacked(proj):
    return np.stack([linear(t[f"{block}.experts.{i}.{proj}.weight"])
                     for i in range(cfg.num_experts)])
  return {"router": {"kernel": linear(t[block + ".gate.weight"])},
          "wi_0": stacked(names.gate), "wi_1": stacked(names.up),
          "wo": stacked(names.down)}


def _experts_to(cfg, names: ExpertNames, mlp, prefix: str):
  linear, block = family.torch_linear, prefix + names.block
  t = {block + ".gate.weight": linear(mlp["router"]["kernel"])}
  for ours, proj in (("wi_0", names.gate), ("wi_1", names.up),
                     ("wo", names.down)):
    for i in range(cfg.num_experts):
      t[f"{block}.experts.{i}.{proj}.weight"] = linear(mlp[ours][i])
  return t


# The whole model: Llama's mapping layer by layer, the experts' tensors in
# place of the dense MLP's on the layers that have them. A family passes its
# names and its layer's options (functools.partial).

def _outer(cfg):
  """What llama's whole-model mapping reads of a config with no layers: its
  embedding, final norm and output layer alone."""
  return types.SimpleNamespace(vocab_size=cfg.vocab_size, emb_dim=cfg.emb_dim,
                               tie_embeddings=cfg.tie_embeddings,
                               num_layers=0)


def tensor_shapes(cfg, tensors, names: ExpertNames, **options):
  shapes = llama.tensor_shapes(_outer(cfg), tensors)
  for i, sparse in enumerate(cfg.sparse_layers):
    prefix = f"model.layers.{i}."
    shapes.update(llama.hf_layer_shapes(cfg, prefix, llama.NORMS,
                                        mlp=not sparse, **options))
    if sparse:
      shapes.update(_expert_shapes(cfg, names, prefix,
                                   _fused(tensors, prefix)))
  return shapes


def from_hf(cfg, t, names: ExpertNames, **options) -> Dict[str, Any]:
  params = llama.from_hf(_outer(cfg), t)
  dec = params["decoder"]
  for i, sparse in enumerate(cfg.sparse_layers):
    prefix = f"model.layers.{i}."
    layer = llama.hf_layer_from(cfg, t, prefix, llama.NORMS, mlp=not sparse,
                                **options)
    if sparse:
      layer["mlp"] = _experts_from(cfg, names, t, prefix)
    dec[f"layers_{i}"] = layer
  return params


def to_hf(cfg, params, names: ExpertNames, **options) -> Dict[str, Any]:
  dec = params["decoder"]
  t = llama.to_hf(_outer(cfg), params)
  for i, sparse in enumerate(cfg.sparse_layers):
    prefix = f"model.layers.{i}."
    layer = dec[f"layers_{i}"]
    t.update(llama.hf_layer_to(cfg, layer, prefix, llama.NORMS,
                               mlp=not sparse, **options))
    if sparse:
      t.update(_experts_to(cfg, names, layer["mlp"], prefix))
  return t


def hf_mapping(architecture: str, model_type: str, names: ExpertNames, *,
               config_from_hf, config_to_hf, **options) -> family.HFMapping:
  """The `family.HFMapping` of a MoE family with Llama's layer (and its
  attention `options`: qk_norm=True for Qwen's)."""
  bind = functools.partial
  return family.HFMapping(
      architecture=architecture, model_type=model_type,
      config_from_hf=config_from_hf, config_to_hf=config_to_hf,
      tensor_shapes=bind(tensor_shapes, names=names, **options),
      from_hf=bind(from_hf, names=names, **options),
      to_hf=bind(to_hf, names=names, **options),
      reconcile=llama.reconcile, ignored=llama.HF_IGNORED)


def hf_moe_fields(hf, architecture: str) -> Dict[str, Any]:
  """The shared `MoeConfig` fields of a config.json (`num_experts`, or
  Mixtral's `num_local_experts`; `num_experts_per_tok`;
  `router_aux_loss_coef`); `llama.hf_config_fields` reads the rest."""
  experts = hf.get("num_experts", hf.get("num_local_experts"))
  if experts is None:
    raise family.HFCheckpointError(
        f"{architecture}: config.json lacks num_experts (or "
        "num_local_experts).")
  return dict(num_experts=int(experts),
              num_experts_per_tok=family.hf_int(hf, "num_experts_per_tok"),
              router_aux_loss_coef=float(hf.get("router_aux_loss_coef",
                                                0.001)))
