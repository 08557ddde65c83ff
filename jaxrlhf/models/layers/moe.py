"""A dropless mixture-of-experts MLP (`MoeMlp`), its router's
load-balancing loss (`load_balancing_loss`) and per-expert load
(`expert_load`).

Each token's router picks its top-k experts; every (token, expert) copy is
computed: no capacity factor, nothing dropped. The copies are sorted by
expert so that each expert's rows are contiguous, and the three SwiGLU
projections are grouped matrix products (`jax.lax.ragged_dot`) with the
experts' row counts as group sizes.

Expert parallelism: when the current logical-axis rules split the
`expert` axis of the expert weights over mesh axes (`sharding.experts_over`)
and the current mesh (`jax.set_mesh`, as `sharding.activate` sets) gives
those axes D > 1 devices, each device holds num_experts / D experts and
computes only theirs, as a sharded grouped product under `jax.shard_map`:
the tokens (with their routing) are all-gathered over the expert axes, each
device runs the grouped products on the copies routed to its own experts,
and the partial outputs are summed back to the devices that own the tokens
by a reduce-scatter (tokens that do not split evenly over the devices are
padded with tokens routed nowhere). Still dropless: a device's buffers hold
every gathered copy (D times its own tokens' copies), so no routing can
overflow them; an all-to-all sending each copy to its expert's device only
would need ragged buffers (`jax.lax.ragged_all_to_all`) and is not done
here. Routing is computed outside, as unsplit, so the result equals the
unsplit block's up to the order of the float sums.

Data parallelism: with the experts whole, when the current rules split the
batch over mesh axes of D > 1 devices (`batch_mesh_axes`), the sort and the
grouped products run per device on its own tokens (`jax.shard_map` over
those axes, each device given every expert's weights, as any layer's are
gathered under fully sharded rules): sorting the tokens of the whole batch
by expert would otherwise make the compiler gather every device's token
copies [tokens * top_k, embed] to each of them.
"""

import math
from typing import Any, Dict, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxrlhf.models.layers import linears

Array = jax.Array

# Router replay. A forward pass given the variable collection ROUTING holds,
# at each `MoeMlp`'s scope, EXPERTS int [batch, length, top_k]: the experts
# each token is routed to (-1 first: its own top k). A forward pass applied
# with INTERMEDIATES mutable records there, under EXPERTS, the experts it
# routed each token to (int32 [batch, length, top_k]), beside the router
# logits its block sows (`jaxrlhf.models.moe_decoder`).
ROUTING = "routing"
INTERMEDIATES = "intermediates"
EXPERTS = "experts"


def route(router_logits: Array, top_k: int, norm_topk_prob: bool,
          replayed: Optional[Array] = None) -> Tuple[Array, Array]:
  """Top-k routing of router_logits [tokens, experts].

  Returns (weights float32 [tokens, top_k], experts int32 [tokens, top_k]):
  the softmax probabilities (over all experts, in float32) of each token's
  k most probable experts, renormalised to sum to 1 when `norm_topk_prob`.

  replayed: int [tokens, top_k] experts chosen elsewhere (router replay:
  the sampler's choice, `ROUTING`); a token whose first entry is negative
  takes its own top k. The replayed experts' weights are this router's
  probabilities of them, renormalised alike, so a loss's gradient still
  reaches the router through the chosen experts' weights (Rollout Routing
  Replay, "R3", arXiv 2510.11370: the inference engine's routing mask is
  replayed in training, the gate values computed from the training
  router's logits).
  """
  probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
  weights, experts = jax.lax.top_k(probs, top_k)
  experts = experts.astype(jnp.int32)
  if replayed is not None:
    replayed = replayed.astype(jnp.int32)
    experts = jnp.where(replayed[:, :1] >= 0, replayed, experts)
    weights = jnp.take_along_axis(probs, experts, axis=-1)
  if norm_topk_prob:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return weights, experts


def _local_experts(tokens: Array, experts: Array, wi_0: Array, wi_1: Array,
                   wo: Array, first: Optional[Array] = None,
                   adapters: Optional[Dict[str, Tuple[Array, Array]]] = None
                   ) -> Array:
  """The SwiGLU outputs of the (token, expert) copies routed to experts
  [first, first + g), zeros for the other copies; of every copy when
  `first` is None (the weights hold all the experts).

  tokens [tokens, embed]; experts int32 [tokens, top_k]; wi_0, wi_1
  [g, embed, mlp] and wo [g, mlp, embed] (experts first .. first + g - 1);
  adapters: {projection name: LoRA's (A [g, in, r], B [g, r, out])} of the
  adapted ones, whose products add (rows . A) . B, grouped alike.
  Returns [tokens, top_k, embed] in the tokens' dtype.
  """
  g = wi_0.shape[0]
  k = experts.shape[1]
  ids = experts.reshape(-1)                            # [tokens * k]
  if first is not None:
    # Copies for other devices' experts sort last (group g) and are in no
    # group: ragged_dot leaves their rows out.
    local = ids - first
    ids = jnp.where((local >= 0) & (local < g), local, g)
  # Stable sort: each expert's copies contiguous, in token order.
  order = jnp.argsort(ids, stable=True)
  rows = tokens[order // k]                            # [tokens * k, embed]
  group_sizes = jnp.bincount(ids, length=g + 1)[:g].astype(jnp.int32)
  adapters = adapters or {}

  def grouped(x, w, name):
    y = jax.lax.ragged_dot(x, w, group_sizes)
    if name in adapters:
      a, b = adapters[name]
      y = y + jax.lax.ragged_dot(jax.lax.ragged_dot(x, a, group_sizes), b,
                                 group_sizes)
    return y
  gate = grouped(rows, wi_0, "wi_0")
  up = grouped(rows, wi_1, "wi_1")
  out = grouped(jax.nn.silu(gate) * up, wo, "wo")
  if first is not None:
    # Zero the rows in no group, whatever a backend's ragged_dot leaves
    # there.
    out = jnp.where((ids[order] < g)[:, None], out, jnp.zeros_like(out))
  unsorted = jnp.zeros_like(out).at[order].set(out)    # copy order again
  return unsorted.reshape(tokens.shape[0], k, -1)


def _combine(copies: Array, weights: Array) -> Array:
  """copies [tokens, top_k, embed] weighted by weights [tokens, top_k] and
  summed over top_k: [tokens, embed]."""
  return jnp.sum(copies * weights[..., None], axis=1)


def _devices_over(mesh, axes: Tuple[str, ...]) -> int:
  """The number of devices of `mesh` over its `axes`."""
  return math.prod(mesh.shape[a] for a in axes)


def _first_axis_mesh_axes(logical: Tuple[str, ...]):
  """(the mesh axes the current rules give the first of the `logical` axes
  of one array, as a tuple; () when none or there is no mesh, the current
  abstract mesh)."""
  spec = nn.logical_to_mesh_axes(logical)
  axes = spec[0] if spec is not None and len(spec) else None
  mesh = jax.sharding.get_abstract_mesh()
  if axes is None or mesh.empty:
    return (), mesh
  return (tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)), mesh


def expert_mesh_axes(num_experts: int) -> Tuple[str, ...]:
  """The mesh axes the current rules split the expert weights' `expert`
  axis over, or () when it is not split (no rule, no mesh, or one device).

  Read from the whole weight's axes ("expert", "embed", "mlp"), so that a
  mesh axis an earlier rule gives to `embed` or `mlp` is not counted twice.
  Raises ValueError when num_experts does not split evenly over them.
  """
  axes, mesh = _first_axis_mesh_axes(("expert", "embed", "mlp"))
  if not axes:
    return ()
  missing = [a for a in axes if a not in mesh.axis_names]
  if missing:
    raise ValueError(f"MoeMlp: the logical-axis rules map 'expert' to mesh "
                     f"axes {missing} that the mesh {mesh.axis_names} "
                     "lacks; fix the expert rule in "
                     "config.sharding.logical_axis_rules")
  ways = _devices_over(mesh, axes)
  if ways == 1:
    return ()
  if num_experts % ways:
    raise ValueError(f"MoeMlp: num_experts={num_experts} does not split over "
                     f"mesh axes {axes} of {ways} devices; use an expert "
                     "count divisible by them or another expert rule in "
                     "config.sharding.logical_axis_rules")
  return axes


def _expert_parallel(tokens: Array, weights: Array, experts: Array,
                     wi_0: Array, wi_1: Array, wo: Array,
                     axes: Tuple[str, ...], adapters=None) -> Array:
  """The sharded grouped product over mesh `axes` (see the module
  docstring): tokens [tokens, embed], weights [tokens, top_k] in the
  tokens' dtype, experts int32 [tokens, top_k], expert weights (and their
  LoRA `adapters`, as `_local_experts`) whole (split by the shard_map) ->
  y [tokens, embed]."""
  name = _axis_name(axes)

  def local(tokens, weights, experts, wi_0, wi_1, wo, adapters):
    # Each device: its 1/D share of the tokens in, all of them here.
    tokens, weights, experts = (
        jax.lax.all_gather(v, name, axis=0, tiled=True)
        for v in (tokens, weights, experts))
    first = jax.lax.axis_index(name) * wi_0.shape[0]
    partial = _combine(
        _local_experts(tokens, experts, wi_0, wi_1, wo, first, adapters),
        weights)
    # Each token's sum over the devices' experts, on the device it came from.
    return jax.lax.psum_scatter(partial, name, scatter_dimension=0,
                                tiled=True)

  return _tokens_over(axes, local, True, tokens, weights, experts, wi_0, wi_1,
                      wo, adapters)


def _axis_name(axes: Tuple[str, ...]):
  """The shard_map axis name of mesh `axes`: one name, or their tuple."""
  return axes if len(axes) > 1 else axes[0]


def _tokens_over(axes: Tuple[str, ...], local, split_experts: bool,
                 tokens: Array, weights: Array, experts: Array, wi_0: Array,
                 wi_1: Array, wo: Array, adapters=None) -> Array:
  """`local(tokens, weights, experts, wi_0, wi_1, wo, adapters)` under
  `jax.shard_map` over mesh `axes`: the tokens (padded to split evenly,
  `_pad_tokens`) and their routing split over them, the expert weights and
  adapters split along their expert axis when `split_experts`, else whole
  on each device -> y [tokens, embed], the padding cut off."""
  mesh = jax.sharding.get_abstract_mesh()
  n = tokens.shape[0]
  tokens, weights, experts = _pad_tokens(tokens, weights, experts,
                                         _devices_over(mesh, axes))
  spec = P(_axis_name(axes))
  y = jax.shard_map(
      local, mesh=mesh, axis_names=set(axes),
      in_specs=(spec,) * 3 + ((spec if split_experts else P()),) * 4,
      out_specs=spec)(tokens, weights, experts, wi_0, wi_1, wo,
                      adapters or {})
  return y[:n]


def batch_mesh_axes() -> Tuple[str, ...]:
  """The mesh axes the current rules split the batch over (those of the
  current mesh with more than one device), or () when it is not split."""
  axes, mesh = _first_axis_mesh_axes(("batch",))
  return tuple(a for a in axes
               if a in mesh.axis_names and mesh.shape[a] > 1)


def _pad_tokens(tokens: Array, weights: Array, experts: Array, ways: int):
  """tokens [n, embed], weights and experts [n, top_k] padded to a multiple
  of `ways` rows with tokens routed to no expert (id -1), so that they split
  evenly over the devices; those are computed by none and cut off after."""
  pad = -tokens.shape[0] % ways
  if not pad:
    return tokens, weights, experts
  return (jnp.pad(tokens, ((0, pad), (0, 0))),
          jnp.pad(weights, ((0, pad), (0, 0))),
          jnp.pad(experts, ((0, pad), (0, 0)), constant_values=-1))


def _data_parallel(tokens: Array, weights: Array, experts: Array,
                   wi_0: Array, wi_1: Array, wo: Array,
                   axes: Tuple[str, ...], adapters=None) -> Array:
  """The whole experts' grouped products on each device's own tokens
  (see the module docstring): the arguments as `_expert_parallel`'s, the
  tokens split over the batch's mesh `axes`, the expert weights (and
  adapters) whole on each device -> y [tokens, embed]."""
  def local(tokens, weights, experts, wi_0, wi_1, wo, adapters):
    return _combine(_local_experts(tokens, experts, wi_0, wi_1, wo,
                                   adapters=adapters), weights)

  return _tokens_over(axes, local, False, tokens, weights, experts, wi_0,
                      wi_1, wo, adapters)


def adapter_names(name: str) -> Tuple[str, str]:
  """The names of LoRA's A [expert, in, r] and B [expert, r, out] (B
  already times alpha / r) of expert projection `name` ("wi_0", "wi_1",
  "wo") beside it in a view's parameters (`jaxrlhf.models.lora.view`)."""
  return f"{name}_lora_a", f"{name}_lora_b"


class MoeMlp(nn.Module):
  """Router linear, softmax over experts, top-k, then the chosen experts'
  gated SwiGLU MLPs (silu(x wi_0) * (x wi_1)) wo, summed with the routing
  weights.

  Parameters: `router/kernel` [embed, expert]; `wi_0`, `wi_1`
  [expert, embed, mlp] and `wo` [expert, mlp, embed], float32, cast to
  `dtype` at every read (as `linears.DenseGeneral`). LoRA: where the
  parameters given to `apply` hold an expert projection's adapters
  (`adapter_names`), each expert's product gains its low-rank update,
  (x . A_e) . B_e, as two more grouped products (the weights are never
  merged, so a small update is not lost to a bfloat16 base's rounding);
  split over experts as the weights are.

  Routing: its own top k, or the experts the variables' `ROUTING`
  collection replays (`route`); the experts used are sown in
  `INTERMEDIATES` (`EXPERTS`), where that collection is mutable.
  """
  num_experts: int
  top_k: int
  mlp_dim: int
  norm_topk_prob: bool = True
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Tuple[Array, Array]:
    """x [batch, length, embed] -> (y [batch, length, embed] in `dtype`,
    router_logits float32 [batch, length, experts])."""
    if not 1 <= self.top_k <= self.num_experts:
      raise ValueError(f"MoeMlp: top_k={self.top_k} must be in "
                       f"[1, num_experts={self.num_experts}]")
    batch, length, embed = x.shape
    e, k, mlp = self.num_experts, self.top_k, self.mlp_dim
    # Before any parameter is made: a split that cannot be made is named.
    axes = expert_mesh_axes(e)
    router_logits = linears.DenseGeneral(
        (e,), ("embed", "expert"), dtype=self.dtype, name="router")(x)
    router_logits = router_logits.astype(jnp.float32)
    init_in = linears.kernel_init(1, 1)

    def expert_kernel(name, shape, axes):
      # Fan-in over the one input axis of each expert's own matrix.
      def init(key, shape, dtype):
        keys = jax.random.split(key, shape[0])
        return jax.vmap(lambda kk: init_in(kk, shape[1:], dtype))(keys)
      return self.param(name, nn.with_logical_partitioning(init, axes),
                        shape, jnp.float32).astype(self.dtype)

    wi_0 = expert_kernel("wi_0", (e, embed, mlp), ("expert", "embed", "mlp"))
    wi_1 = expert_kernel("wi_1", (e, embed, mlp), ("expert", "embed", "mlp"))
    wo = expert_kernel("wo", (e, mlp, embed), ("expert", "mlp", "embed"))
    adapters = {}
    for name in ("wi_0", "wi_1", "wo"):
      a, b = adapter_names(name)
      if self.has_variable("params", a):
        adapters[name] = (self.get_variable("params", a).astype(self.dtype),
                          self.get_variable("params", b).astype(self.dtype))

    tokens = x.reshape(batch * length, embed).astype(self.dtype)
    replayed = None
    if self.has_variable(ROUTING, EXPERTS):
      replayed = self.get_variable(ROUTING, EXPERTS)
      if replayed.shape != (batch, length, k):
        raise ValueError(f"MoeMlp: the replayed routing has shape "
                         f"{replayed.shape}, not [batch, length, top_k] = "
                         f"{(batch, length, k)}")
      replayed = replayed.reshape(-1, k)
    weights, experts = route(router_logits.reshape(-1, e), k,
                             self.norm_topk_prob, replayed)
    self.sow(INTERMEDIATES, EXPERTS, experts.reshape(batch, length, k))
    weights = weights.astype(self.dtype)
    data_axes = () if axes else batch_mesh_axes()
    if axes:
      y = _expert_parallel(tokens, weights, experts, wi_0, wi_1, wo, axes,
                           adapters)
    elif data_axes:
      y = _data_parallel(tokens, weights, experts, wi_0, wi_1, wo,
                         data_axes, adapters)
    else:
      y = _combine(_local_experts(tokens, experts, wi_0, wi_1, wo,
                                  adapters=adapters), weights)
    return (y.reshape(batch, length, embed),
            router_logits.reshape(batch, length, e))


def _token_mask(router_logits: Array, mask: Optional[Array]) -> Array:
  """float32 of router_logits' leading shape (one entry per token): ones, or
  `mask` in that shape (1 counts, 0 ignored).

  The token axes are kept apart, not flattened: merging a split batch axis
  with the unsplit axes around it (layers, length) would make the compiler
  gather every device's router logits to each of them.
  """
  shape = router_logits.shape[:-1]
  if mask is None:
    return jnp.ones(shape, jnp.float32)
  if mask.size != math.prod(shape):
    raise ValueError(f"load_balancing_loss: mask has {mask.size} entries "
                     f"but router_logits has {math.prod(shape)} tokens; give "
                     "one mask entry per token (tile it over layers)")
  return mask.reshape(shape).astype(jnp.float32)


def expert_load(router_logits: Array, top_k: int,
                mask: Optional[Array] = None) -> Array:
  """float32 [experts]: the share of the counted tokens' routed slots
  (top_k per token) that each expert received; sums to 1.

  router_logits [..., experts] (any leading axes: layers, batch, length);
  mask: one entry per token of the leading axes, or None (all count).
  """
  e = router_logits.shape[-1]
  m = _token_mask(router_logits, mask)
  _, experts = jax.lax.top_k(router_logits, top_k)       # [..., top_k]
  counts = jnp.sum(jax.nn.one_hot(experts, e) * m[..., None, None],
                   axis=tuple(range(m.ndim + 1)))
  return counts / jnp.maximum(top_k * jnp.sum(m), 1.0)


def load_balancing_loss(router_logits: Array, top_k: int, num_experts: int,
                        mask: Optional[Array] = None) -> Array:
  """The router's auxiliary loss as transformers' `load_balancing_loss_func`
  defines it (Switch Transformer's, with top-k):

    num_experts * sum_e f_e * P_e

  f_e: the counted tokens whose top-k includes expert e, over the counted
  tokens (so sum_e f_e = top_k); P_e: the mean softmax probability of e over
  the counted tokens. Equal to top_k when the router is uniform in both.
  Scale it by `router_aux_loss_coef` outside.

  router_logits [..., experts] (layers' logits stacked or concatenated on
  the leading axes, as transformers concatenates them); mask: one entry per
  token of the leading axes (1 counts), or None. Returns float32 [].
  """
  if router_logits.shape[-1] != num_experts:
    raise ValueError(f"load_balancing_loss: router_logits' last axis is "
                     f"{router_logits.shape[-1]}, not num_experts="
                     f"{num_experts}")
  logits = router_logits.astype(jnp.float32)
  m = _token_mask(router_logits, mask)
  tokens = tuple(range(m.ndim))
  total = jnp.maximum(jnp.sum(m), 1.0)
  probs = jax.nn.softmax(logits, axis=-1)
  _, experts = jax.lax.top_k(probs, top_k)
  # [..., experts]: 1 where the expert is among the token's top k.
  chosen = jnp.sum(jax.nn.one_hot(experts, num_experts), axis=-2)
  f = jnp.sum(chosen * m[..., None], axis=tokens) / total
  p = jnp.sum(probs * m[..., None], axis=tokens) / total
  return num_experts * jnp.sum(f * p)
