"""LoRA: low-rank adapters on a model's dense projections.

Hu et al. 2021: a frozen kernel W [*in, *out] gains a trained update
A [*in, r] . B [r, *out] scaled by alpha / r, B starting at zero so that
the adapted model starts as the base exactly. Here:

  - the adapters are a tree of their own, `{..., <projection>: {"lora_a",
    "lora_b"}}` at the paths of the adapted `linears.DenseGeneral`s of the
    base's parameter tree (`init_adapters`), so that the optimizer sees
    only them and a checkpoint holds only them;
  - `view(base, adapters, spec)` is what the model runs on: the base tree
    with each adapted projection's `lora_a` and `lora_b` (already times
    alpha / r) beside its kernel, a plain dictionary union, so that
    gradients of the view reach only the adapters. `DenseGeneral` adds
    (x . A) . B when its parameters hold them and is the base alone when
    they do not: the frozen base is the reference with the adapters off,
    with no second copy of the weights. In training, the adapter dropout's
    key and rate travel in the view too (Linen modules get nothing else
    per call without every family passing it on);
  - `merged` folds the adapters into the kernels (W + A . B alpha / r:
    what `export_hf` writes), `export_peft` writes the adapters as a PEFT
    adapter folder that `peft` loads onto the transformers model;
  - `checksum` names a base by its weights (an integer hash of their bits,
    the same on any mesh), so a LoRA run can refuse a changed base.

Which projections are adapted: the `DenseGeneral`s whose scope name is in
`LoraSpec.targets` (the attention's query/key/value/out, the MLP's
wi/wi_0/wi_1/wo, in every family; T5's cross-attention's too), optionally
only in some layers (`layers_{i}` of an unrolled stack). They are found by
tracing the model's initialisation once with a Flax method interceptor
(`adapter_sites`): no family declares them. A mixture-of-experts layer's
experts (`layers.moe.MoeMlp`'s stacked wi_0, wi_1, wo [experts, in, out],
plain parameters) are adapted where the targets name `EXPERTS`: each
expert its own A [experts, in, r] and B [experts, r, out], held in a view
beside the weight under `moe.adapter_names` (the default targets leave
them, as PEFT's do a transformers MoE's fused experts).

qwix (Google's LoRA/quantisation library, which Tunix uses) was tried on
these modules and not used: its Linen LoRA cannot run the base without the
adapter parameters (ScopeParamNotFoundError), so the reference would need a
second module; its dropout is on in every call, sampling and evaluation
included (it asks for a 'dropout' RNG everywhere); and it flattens the
adapters of multi-axis projections ([heads, kv] -> heads * kv under the one
logical name 'heads'). The README's "Models and checkpoints" says more.
"""

import dataclasses
import functools
import json
import math
import os
import pathlib
import re
from typing import Any, Dict, Optional, Tuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.models import family
from jaxrlhf.models import hf_io
from jaxrlhf.models import llama
from jaxrlhf.models import registry
from jaxrlhf.models.layers import decoders
from jaxrlhf.models.layers import linears
from jaxrlhf.models.layers import moe

# The projections of every family: attention (T5's cross-attention too) and
# MLP (the gated MLP's wi_0/wi_1, the plain MLP's wi).
DEFAULT_TARGETS = ("query", "key", "value", "out", "wi", "wi_0", "wi_1", "wo")
# The target that adapts every MoE layer's experts (wi_0, wi_1 and wo).
EXPERTS = "experts"
_EXPERT_WEIGHTS = ("wi_0", "wi_1", "wo")
# The view's extra leaves in an adapted projection's parameters.
A, B = "lora_a", "lora_b"
DROPOUT_KEY, DROPOUT_RATE = "lora_dropout_key", "lora_dropout_rate"
_LAYER = re.compile(r"^layers_(\d+)$")

Path = Tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class LoraSpec:
  """What is adapted and how (`config.lora`).

  Attributes:
    rank: r, the adapters' inner width.
    alpha: their update is multiplied by alpha / r (PEFT's lora_alpha).
    dropout: the rate at which x's entries are dropped on the adapters'
      path in training.
    targets: names of the adapted projections (`DenseGeneral` scopes).
    layers: indices of the adapted layers (`layers_{i}` of each unrolled
      stack); None = every layer.
  """
  rank: int
  alpha: float
  dropout: float = 0.0
  targets: Tuple[str, ...] = DEFAULT_TARGETS
  layers: Optional[Tuple[int, ...]] = None

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  @classmethod
  def from_config(cls, lora_cfg) -> Optional["LoraSpec"]:
    """The spec of a `config.lora` group (a ConfigDict or a dict, as a run's
    config.json holds it); None when rank is 0 (LoRA off)."""
    get = lora_cfg.get
    if not get("rank"):
      return None
    targets = tuple(t.strip() for t in str(get("targets") or "").split(",")
                    if t.strip()) or DEFAULT_TARGETS
    text = str(get("layers") or "").strip()
    try:
      chosen = (tuple(sorted({int(i) for i in text.split(",") if i.strip()}))
                if text else None)
    except ValueError:
      raise ValueError(f"config.lora.layers: {text!r} is not a comma-"
                       "separated list of layer indices (e.g. '0,1,2'); "
                       "'' adapts every layer.") from None
    return cls(rank=int(get("rank")), alpha=float(get("alpha")),
               dropout=float(get("dropout") or 0.0), targets=targets,
               layers=chosen)


# ----------------------------------------------------------------------------
# Where the adapters go.

@dataclasses.dataclass(frozen=True)
class Site:
  """An adapted projection: its kernel's input and output axis counts (the
  kernel [*stack, *in, *out] may have stacked layers, or experts, in
  front); `experts`: the kernel is the parameter at the site's path itself,
  a MoE layer's stacked expert weight (target `EXPERTS`), not a
  `DenseGeneral`'s "kernel"."""
  num_in: int
  num_out: int
  experts: bool = False

  def target(self, path: Path) -> str:
    """The name `LoraSpec.targets` adapts it by."""
    return EXPERTS if self.experts else path[-1]


@functools.lru_cache(maxsize=32)
def _projections(module) -> Dict[Path, Site]:
  """{scope path: Site} of every `DenseGeneral` the module calls, from one
  abstract trace of its initialisation (scanned stacks have one path,
  `.../layers/...`, for all their layers)."""
  found = {}

  def record(next_fun, args, kwargs, context):
    m = context.module
    if context.method_name == "__call__":
      if isinstance(m, linears.DenseGeneral):
        found[tuple(m.scope.path)] = Site(m.num_in_axes,
                                          len(tuple(m.features)))
      elif isinstance(m, moe.MoeMlp):
        for name in _EXPERT_WEIGHTS:
          found[tuple(m.scope.path) + (name,)] = Site(1, 1, experts=True)
    return next_fun(*args, **kwargs)

  kind = registry.family_of(module).kind
  # Everything inside eval_shape: nothing runs (a plan's mesh may be a
  # topology without devices here).
  with nn.intercept_methods(record), nn.logical_axis_rules(()):
    jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0),
                                       *family.init_args(module, kind)))
  return found


def adapter_sites(module, spec: LoraSpec) -> Dict[Path, Site]:
  """{scope path: Site} of the projections `spec` adapts in `module`.

  Raises:
    ValueError: a target that names no projection of the model, a layer it
      does not have, or layers picked in a scanned stack (one array holds
      every layer's adapters there).
  """
  every = _projections(module)
  names = sorted({site.target(path) for path, site in every.items()})
  unknown = [t for t in spec.targets if t not in names]
  if len(unknown) == len(spec.targets):
    raise ValueError(
        f"config.lora.targets: {','.join(spec.targets)!r} names no "
        f"projection of this model; its projections are {names}.")
  sites = {}
  seen_layers = set()
  for path, site in every.items():
    if site.target(path) not in spec.targets:
      continue
    if site.experts and spec.dropout > 0:
      raise ValueError(
          f"config.lora.dropout: {spec.dropout}: the experts' adapters "
          f"(target {EXPERTS!r}) have no dropout; set lora.dropout=0 or "
          f"leave {EXPERTS!r} out of lora.targets.")
    if spec.layers is not None:
      if "layers" in path:
        raise ValueError(
            "config.lora.layers: a scanned layer stack "
            "(config.model.scan_layers) holds every layer's adapters in "
            "one array; pick layers with model.scan_layers=False, or set "
            "lora.layers to '' to adapt every layer.")
      index = [int(m.group(1)) for m in map(_LAYER.match, path) if m]
      if not index or index[0] not in spec.layers:
        continue
      seen_layers.add(index[0])
    sites[path] = site
  if spec.layers is not None:
    missing = sorted(set(spec.layers) - seen_layers)
    if missing:
      raise ValueError(f"config.lora.layers: the model has no layer(s) "
                       f"{missing}.")
  return sites


def _get(tree, path: Path):
  for key in path:
    tree = tree[key]
  return tree


def _set(tree, path: Path, value):
  """`tree` (nested dicts) with `value` at `path`, parents created."""
  out = dict(tree)
  if len(path) == 1:
    out[path[0]] = value
  else:
    out[path[0]] = _set(tree.get(path[0], {}), path[1:], value)
  return out


def _names(leaf, ndim: int) -> Tuple[Optional[str], ...]:
  names = getattr(leaf, "names", None)
  return tuple(names) if names is not None else (None,) * ndim


def init_adapters(rng, base, sites: Dict[Path, Site], spec: LoraSpec):
  """Fresh adapters for the `sites` of the (boxed or plain) parameter tree
  `base`: A uniform in +-1/sqrt(fan_in) (PEFT's default), B zero, each
  boxed with the logical names of the kernel axes it spans (the rank axis
  replicated), so they shard as their kernels do."""
  out = {}
  for i, (path, site) in enumerate(sorted(sites.items())):
    kernel = _get(base, path)
    if not site.experts:
      kernel = kernel["kernel"]
    value = nn.meta.unbox(kernel) if isinstance(
        kernel, nn.meta.AxisMetadata) else kernel
    shape, names = tuple(value.shape), _names(kernel, len(value.shape))
    stack = len(shape) - site.num_in - site.num_out
    lead, inner, outer = (shape[:stack], shape[stack:stack + site.num_in],
                          shape[stack + site.num_in:])
    lead_n, in_n, out_n = (names[:stack], names[stack:stack + site.num_in],
                           names[stack + site.num_in:])
    bound = 1.0 / math.sqrt(math.prod(inner))
    a = jax.random.uniform(jax.random.fold_in(rng, i),
                           lead + inner + (spec.rank,), jnp.float32,
                           -bound, bound)
    b = jnp.zeros(lead + (spec.rank,) + outer, jnp.float32)
    out = _set(out, path, {
        A: nn.LogicallyPartitioned(a, lead_n + in_n + (None,)),
        B: nn.LogicallyPartitioned(b, lead_n + (None,) + out_n)})
  return out


# ----------------------------------------------------------------------------
# The view the model runs on, and merged weights.

def _adapted(tree) -> bool:
  return isinstance(tree, dict) and A in tree and B in tree


def _stack_dims(a, b, kernel_ndim: int) -> int:
  """Leading stacked-layer axes of an adapter pair (a [*s, *in, r],
  b [*s, r, *out], kernel [*s, *in, *out])."""
  return a.ndim + b.ndim - 2 - kernel_ndim


def view(base, adapters, spec: LoraSpec, dropout_rng=None):
  """`base` with each adapted projection's A and B * alpha / r beside its
  kernel: the parameters the adapted model runs on (a differentiable
  union: gradients reach `adapters` alone). With `dropout_rng` and
  `spec.dropout` > 0, also each projection's dropout key and rate (one key
  per stacked layer)."""
  counter = [0]

  def merge(b_node, a_node):
    if _adapted(a_node):
      kernel = b_node["kernel"]
      lora_b = a_node[B]
      node = dict(b_node, **{A: a_node[A],
                             B: lora_b * jnp.asarray(spec.scale, lora_b.dtype)})
      if dropout_rng is not None and spec.dropout > 0:
        lead = a_node[A].shape[:_stack_dims(a_node[A], lora_b, kernel.ndim)]
        key = jax.random.fold_in(dropout_rng, counter[0])
        counter[0] += 1
        keys = jax.random.split(key, math.prod(lead) or 1)
        node[DROPOUT_KEY] = keys.reshape(lead + (2,)) if lead else keys[0]
        node[DROPOUT_RATE] = jnp.full(lead, spec.dropout, jnp.float32)
      return node
    out = dict(b_node)
    for k, v in a_node.items():
      if k not in b_node:
        raise ValueError(f"LoRA adapters at {k!r} have no base parameters.")
      if _adapted(v) and not isinstance(b_node[k], dict):
        # A MoE layer's expert weight: its adapters beside it.
        name_a, name_b = moe.adapter_names(k)
        out[name_a] = v[A]
        out[name_b] = v[B] * jnp.asarray(spec.scale, v[B].dtype)
      else:
        out[k] = merge(b_node[k], v)
    return out

  return merge(_plain(base), _plain(adapters))


def _plain(tree):
  if isinstance(tree, flax.core.FrozenDict):
    return flax.core.unfreeze(tree)
  return tree


def _delta(a, b, kernel_ndim: int, xp):
  """A . B [*s, *in, *out] of a (already scaled) adapter pair."""
  s = _stack_dims(a, b, kernel_ndim)
  lead, inner, outer = a.shape[:s], a.shape[s:-1], b.shape[s + 1:]
  r = a.shape[-1]
  flat = xp.matmul(a.reshape(lead + (-1, r)), b.reshape(lead + (r, -1)))
  return flat.reshape(lead + inner + outer)


def merged(base, adapters, spec: Optional[LoraSpec] = None):
  """Plain parameters with the adapters folded in: W + A . B * alpha / r.
  `adapters` None: `base` is a view (`view`, B scaled already) whose
  adapter leaves are folded into its kernels and dropped. numpy trees stay
  numpy (float32 sums), others are computed with jax.numpy."""
  if adapters is not None:
    base = view(base, adapters, spec)

  def fold(node):
    if not isinstance(node, dict):
      return node
    if _adapted(node):
      kernel, a, b = node["kernel"], node[A], node[B]
      xp = np if isinstance(kernel, np.ndarray) else jnp
      rest = {k: v for k, v in node.items()
              if k not in (A, B, DROPOUT_KEY, DROPOUT_RATE)}
      delta = _delta(xp.asarray(a, kernel.dtype), xp.asarray(b, kernel.dtype),
                     kernel.ndim, xp)
      return dict(rest, kernel=kernel + delta)
    out = {}
    for k, v in node.items():
      if k in _expert_adapter_names(node):
        continue
      name_a, name_b = moe.adapter_names(k)
      if name_a in node:
        xp = np if isinstance(v, np.ndarray) else jnp
        v = v + _delta(xp.asarray(node[name_a], v.dtype),
                       xp.asarray(node[name_b], v.dtype), v.ndim, xp)
      out[k] = fold(v)
    return out

  return fold(_plain(base))


def _expert_adapter_names(node) -> Tuple[str, ...]:
  """The keys of a view's node that are expert weights' adapters."""
  return tuple(n for k in node if not isinstance(node[k], dict)
               for n in moe.adapter_names(k) if n in node)


def has_adapters(tree) -> bool:
  """Whether a parameter tree is a view holding adapters."""
  if not isinstance(tree, (dict, flax.core.FrozenDict)):
    return False
  return (_adapted(tree) or bool(_expert_adapter_names(tree))
          or any(has_adapters(v) for v in tree.values()))


def adapter_matrices(adapters) -> Dict[str, Tuple[Any, Any]]:
  """{"a/b/c": (lora_a, lora_b)} of an adapter tree."""
  out = {}

  def visit(node, path):
    if _adapted(node):
      out["/".join(path)] = (node[A], node[B])
      return
    for k, v in node.items():
      visit(v, path + (k,))

  visit(_plain(adapters), ())
  return out


# ----------------------------------------------------------------------------
# A base named by its weights.

def check_base(base, record, where: str, fix: str = "",
               error=ValueError) -> None:
  """Raises `error` naming `where` when `base`'s weights are not those of
  `record` (a run's `BASE_RECORD`: the base its adapters were trained on);
  `fix` ends the message."""
  found = checksum(base)
  if found != record.get("checksum"):
    named = record.get("checkpoint") or (
        f"a fresh initialisation (seed {record.get('random_init_seed')})")
    raise error(
        f"{where}: the base this LoRA run's adapters were trained on "
        f"({named}, weights checksum {record.get('checksum')}) has changed: "
        f"it now loads with checksum {found}." + (f" {fix}" if fix else ""))


def checksum(params) -> str:
  """A hex digest of a parameter tree's values: each leaf's float32 bits
  times (2 * flat index + 1), summed in uint32 (exact, so the same
  whatever the sharding and the order of the sums), over the sorted leaf
  paths. Any changed weight, or weights moved within a leaf, changes it."""
  flat = sorted((jax.tree_util.keystr(k), v) for k, v in
                jax.tree_util.tree_flatten_with_path(_plain(params))[0])
  sums = jax.jit(lambda leaves: [_leaf_sum(x) for x in leaves])(
      [v for _, v in flat])
  digest = np.asarray(jax.device_get(sums), np.uint32)
  import hashlib  # pylint: disable=g-import-not-at-top
  h = hashlib.sha256()
  for (name, value), s in zip(flat, digest):
    h.update(f"{name}:{tuple(value.shape)}:{int(s)};".encode())
  return h.hexdigest()[:32]


def _leaf_sum(x):
  bits = jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32),
                                      jnp.uint32)
  index = jnp.zeros(bits.shape, jnp.uint32)
  stride = 1
  for d in reversed(range(bits.ndim)):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, d) * (
        jnp.uint32(stride % 2**32))
    stride *= bits.shape[d]
  return jnp.sum(bits * (index * jnp.uint32(2) + jnp.uint32(1)),
                 dtype=jnp.uint32)


# Where a LoRA run's workdir names its base (`lora_state`): {"checkpoint":
# path or "", "resolved": the step it read, "checksum": `checksum` of the
# base, "random_init_seed": for a fresh one}.
BASE_RECORD = "lora_base.json"


def absolute(path: str) -> str:
  """A local path made absolute; a URL (gs://...) as it is."""
  path = os.fspath(path)
  return path if "://" in path else os.path.abspath(path)


def read_base_record(path) -> Optional[Dict[str, Any]]:
  """The base record of the LoRA run at `path` (its workdir, its
  `checkpoints/`, one step or its state item, or its `best/` checkpoint;
  local or gs://), or None."""
  from etils import epath  # pylint: disable=g-import-not-at-top
  path = epath.Path(absolute(path))
  # Climb out of <workdir>[/best]/checkpoints/<step>/state, and no further.
  for name in ("state", None, "checkpoints", "best"):
    if path.name == name or (name is None and path.name.isdigit()):
      path = path.parent
  candidate = path / BASE_RECORD
  if not candidate.exists():
    return None
  return json.loads(candidate.read_text())


# ----------------------------------------------------------------------------
# PEFT adapter folders.

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _peft_module_names(config) -> Dict[Path, str]:
  """{our projection's path under an unrolled stack: the transformers
  module it is} for the families whose Hugging Face layers are Llama's
  (Llama, Qwen2/3, Mistral, Gemma 2/3: `llama.to_hf`)."""
  chosen = registry.family_of(config)
  to_hf = getattr(chosen.hf, "to_hf", None)
  while isinstance(to_hf, functools.partial):
    to_hf = to_hf.func
  if to_hf is not llama.to_hf:
    raise ValueError(
        f"export_peft: {chosen.name} models are not written as PEFT "
        "adapters (the decoder-only families with Llama's layer names are: "
        "llama, qwen2, qwen3, mistral, gemma, gemma3); export the merged "
        "weights with export_hf instead.")
  attention = dict(llama._ATTENTION, out="o_proj")  # pylint: disable=protected-access
  out = {}
  for i in range(config.num_layers):
    for ours, hf in attention.items():
      out[("decoder", f"layers_{i}", "self_attention", ours)] = (
          f"model.layers.{i}.self_attn.{hf}")
    for ours, hf in llama._MLP.items():  # pylint: disable=protected-access
      out[("decoder", f"layers_{i}", "mlp", ours)] = f"model.layers.{i}.mlp.{hf}"
  return out


def export_peft(module_or_config, adapters, spec: LoraSpec, path, *,
                base_model_name_or_path: str = "",
                dtype: str = "float32") -> pathlib.Path:
  """Writes the adapters as a PEFT LoRA folder (`adapter_config.json`,
  `adapter_model.safetensors`) that `peft.PeftModel.from_pretrained(model,
  path)` loads onto the transformers model of the base (`export_hf` of it,
  or the Hugging Face checkpoint the run started from).

  Args:
    module_or_config: the model (or its config) of a family whose layers
      are Llama's in transformers.
    adapters: the adapter tree (a run's `params["policy"]`; scanned or
      unrolled as the config says).
    spec: its `LoraSpec` (rank, alpha, ...).
    path: the output folder (created).
    base_model_name_or_path: what adapter_config.json names as the base.
    dtype: 'float32', 'bfloat16' or 'float16'.
  """
  # pylint: disable=g-import-not-at-top
  from safetensors import numpy as safetensors_np
  config = getattr(module_or_config, "config", module_or_config)
  names = _peft_module_names(config)
  host = jax.tree.map(lambda x: np.asarray(jax.device_get(x), np.float32),
                      _plain(nn.meta.unbox(adapters)))
  if getattr(config, "scan_layers", False) and "layers" in host.get(
      "decoder", {}):
    host = decoders.unstack_layer_params(host, "decoder")
  to_dtype = hf_io._EXPORT_DTYPES[dtype]  # pylint: disable=protected-access
  tensors, modules, layer_ids = {}, set(), set()
  for key, (a, b) in adapter_matrices(host).items():
    ours = tuple(key.split("/"))
    if ours not in names:
      raise ValueError(f"export_peft: the adapted projection {key!r} has no "
                       "transformers module that PEFT adapts.")
    hf = names[ours]
    r = a.shape[-1]
    prefix = f"base_model.model.{hf}"
    tensors[prefix + ".lora_A.weight"] = np.ascontiguousarray(
        a.reshape(-1, r).T).astype(to_dtype)
    tensors[prefix + ".lora_B.weight"] = np.ascontiguousarray(
        b.reshape(r, -1).T).astype(to_dtype)
    modules.add(hf.rsplit(".", 1)[1])
    layer_ids.add(int(hf.split(".")[2]))
  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  adapter_config = {
      "peft_type": "LORA",
      "task_type": "CAUSAL_LM",
      "base_model_name_or_path": base_model_name_or_path or None,
      "r": spec.rank,
      "lora_alpha": spec.alpha,
      "lora_dropout": spec.dropout,
      "target_modules": sorted(modules),
      "layers_to_transform": (sorted(layer_ids) if spec.layers is not None
                              else None),
      "bias": "none",
      "fan_in_fan_out": False,
      "inference_mode": True,
      "init_lora_weights": True,
      "use_rslora": False,
      "use_dora": False,
      "modules_to_save": None,
      "rank_pattern": {},
      "alpha_pattern": {},
  }
  (path / ADAPTER_CONFIG).write_text(
      json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
  safetensors_np.save_file(tensors, path / ADAPTER_WEIGHTS,
                           metadata={"format": "pt"})
  return path
