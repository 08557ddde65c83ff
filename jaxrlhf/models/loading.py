"""Loading a pretrained model from any checkpoint we read, sharded; exporting.

  module, config, params = from_pretrained(path, mesh=mesh)
  logits = module.apply({"params": params}, ...)
  export_hf(module, params, "/tmp/hf_out")

`from_pretrained` recognises three kinds of checkpoint at `path`:

- a Hugging Face folder: config.json (a supported `model_type` /
  `architectures`) and model.safetensors or a sharded index; read with
  `hf_io.load_hf_checkpoint` (every family with a Hugging Face mapping:
  Llama, Qwen2, Qwen3, Mistral, Gemma 2 and 3, GPT-NeoX, T5);
- a T5X checkpoint: a `checkpoint_<step>` directory, its `checkpoint` file,
  or a model directory holding them. T5X checkpoints carry no model config
  (t5x keeps it in gin files), so pass `model_config=` (a `t5.T5Config` or
  `t5x_decoder_only.T5xDecoderOnlyConfig`), or let it be inferred from the
  parameter shapes (`infer_t5x_config`: every dimension and layer count is
  read off the shapes; what shapes cannot tell keeps t5x's defaults —
  a gated MLP is taken to be T5 1.1's gated GELU, a single `wi` ReLU,
  relative-position max distance 128, float32 compute; override those
  fields by keyword, e.g. `mlp_activations=("silu", "linear")`);
- a jaxrlhf run: its workdir, `workdir/checkpoints`, one step
  `checkpoints/<step>` or its `state` item (orbax). The policy network
  (`params/policy`) of the latest (or given) step is read; the model comes
  from the run's `config.json` (`config.model`, via `build_model`), or from
  `model_config=`. A bare orbax checkpoint of a parameter tree also works,
  with `model_config=`. A LoRA run's policy is its base (read from where
  the workdir's `lora_base.json` says, checked against its checksum) with
  the adapters merged in (`jaxrlhf.models.lora`).

Parameters are placed on `mesh` by their logical axis names: the shardings
come from `jax.eval_shape` of the module's init (boxed with
`nn.with_logical_partitioning`), `nn.get_partition_spec` and the rules
(`jaxrlhf.sharding.tree_shardings`). T5X arrays are read shard by shard
(each device reads only its zarr chunks) and orbax arrays restored straight
into their shardings; safetensors are read on the host and each device gets
its slice. Without a mesh everything lands on the default device.

Keyword overrides set fields of the model config (dtype='bfloat16',
scan_layers=True, attention_impl='dot_product', remat_policy='full', ...);
when `scan_layers` differs from the checkpoint's layout the layers are
stacked or unstacked on the host first.
"""

import json
import pathlib
from typing import Any, Optional, Tuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jaxrlhf import checkpoint_files
from jaxrlhf import sharding as sharding_lib
from jaxrlhf import sharding_rules
from jaxrlhf.models import family as family_lib
from jaxrlhf.models import hf_io
from jaxrlhf.models import lora
from jaxrlhf.models import registry
from jaxrlhf.models import t5
from jaxrlhf.models import t5x_checkpoint
from jaxrlhf.models import t5x_decoder_only
from jaxrlhf.models import token_rows

HF, T5X, ORBAX = "huggingface", "t5x", "orbax"


class PretrainedError(ValueError):
  """A checkpoint that cannot be loaded as asked; the message says why."""


# ----------------------------------------------------------------------------
# Modules, configs and their abstract parameters.

module_for_config = registry.module_for_config
abstract_params = registry.abstract_params
relayout_params = registry.relayout_params


def param_shardings(module: nn.Module, mesh, rules=None):
  """NamedShardings of the module's parameters on `mesh` under `rules`."""
  rules = sharding_rules.STANDARD_RULES if rules is None else rules
  return sharding_lib.tree_shardings(abstract_params(module), mesh,
                                     sharding_lib.as_rules(rules))


def check_param_tree(params, module, where: str):
  """Raises PretrainedError naming every missing, unexpected or mis-shaped
  parameter of `params` (arrays or ShapeDtypeStructs) for `module`."""
  want = {k: tuple(v.shape)
          for k, v in family_lib.flat_paths(nn.meta.unbox(abstract_params(module))).items()}
  got = {k: tuple(v.shape) if hasattr(v, "shape") else tuple(np.shape(v))
         for k, v in family_lib.flat_paths(params).items()}
  problems = []
  missing = sorted(set(want) - set(got))
  unexpected = sorted(set(got) - set(want))
  shapes = sorted(f"{k}: checkpoint {got[k]}, model {want[k]}"
                  for k in set(want) & set(got) if want[k] != got[k])
  if missing:
    problems.append(f"missing {missing[:8]}" + (
        f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
  if unexpected:
    problems.append(f"unexpected {unexpected[:8]}" + (
        f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else ""))
  if shapes:
    problems.append("shape mismatch: " + "; ".join(shapes[:8]))
  if problems:
    raise PretrainedError(
        f"{where} does not fit {type(module.config).__name__}"
        f"({_config_summary(module.config)}): " + " | ".join(problems)
        + ". Pass the model_config the checkpoint was trained with.")


def _config_summary(config):
  keys = ("vocab_size", "emb_dim", "num_heads", "num_layers",
          "num_encoder_layers", "num_decoder_layers", "mlp_dim",
          "scan_layers")
  return ", ".join(f"{k}={getattr(config, k)}" for k in keys
                   if hasattr(config, k))


def is_scanned(params, config) -> bool:
  """Whether `params` (arrays or shapes) hold `config`'s family's layers
  stacked under `layers` (the scanned layout)."""
  return any("layers" in params.get(name, {})
             for name, _ in registry.family_of(config).layer_stacks(config))


# ----------------------------------------------------------------------------
# T5X: configs inferred from shapes.

def _layer_count(stack, kind):
  if "layers" in stack:  # scanned t5x checkpoint
    return jax.tree.leaves(stack["layers"])[0].shape[0], stack["layers"], 1
  count = sum(1 for k in stack if k.startswith("layers_"))
  if not count:
    raise PretrainedError(f"The T5X checkpoint's {kind} has no layers_0.")
  return count, stack["layers_0"], 0


def infer_t5x_config(param_shapes, **overrides):
  """A T5Config or T5xDecoderOnlyConfig from a T5X parameter tree's shapes.

  Args:
    param_shapes: nested dict of arrays or ShapeDtypeStructs with t5x names
      (`t5x_checkpoint.t5x_param_shapes(path)['params']`).
    **overrides: fields to set, for what shapes cannot tell (see the module
      docstring): mlp_activations, relpos_max_distance, dtype, ...
  """
  p = param_shapes
  if "encoder" in p and "decoder" in p and "token_embedder" in p:
    vocab, emb = p["token_embedder"]["embedding"].shape
    n_enc, enc_layer, lead = _layer_count(p["encoder"], "encoder")
    n_dec, _, _ = _layer_count(p["decoder"], "decoder")
    table = p["encoder"]["relpos_bias"]["rel_embedding"].shape
    layer, decoder = enc_layer, p["decoder"]
    fields = dict(vocab_size=vocab, emb_dim=emb, num_encoder_layers=n_enc,
                  num_decoder_layers=n_dec,
                  logits_via_embedding="logits_dense" not in decoder,
                  scan_layers=bool(lead))
    query = layer["attention"]["query"]["kernel"].shape[lead:]
    cls = t5.T5Config
  elif set(p) == {"decoder"} and "relpos_bias" in p["decoder"]:
    decoder = p["decoder"]
    vocab, emb = decoder["token_embedder"]["embedding"].shape
    n_dec, layer, lead = _layer_count(decoder, "decoder")
    if lead:
      raise PretrainedError("Scanned t5x decoder-only checkpoints are not "
                            "supported; save it with layers_0, layers_1, ....")
    table = decoder["relpos_bias"]["rel_embedding"].shape
    fields = dict(vocab_size=vocab, emb_dim=emb, num_layers=n_dec,
                  logits_via_embedding="logits_dense" not in decoder)
    query = layer["self_attention"]["query"]["kernel"].shape
    cls = t5x_decoder_only.T5xDecoderOnlyConfig
  else:
    raise PretrainedError(
        f"Cannot infer a model from T5X parameters with top-level keys "
        f"{sorted(p)}: expected encoder/decoder/token_embedder (T5) or "
        "decoder/ with relpos_bias (t5x decoder-only). Pass model_config=.")
  num_heads, num_buckets = table[-2:]
  mlp = layer["mlp"]
  if "wi" in mlp:
    activations, mlp_dim = ("relu",), mlp["wi"]["kernel"].shape[-1]
  else:
    activations, mlp_dim = ("gelu", "linear"), mlp["wi_0"]["kernel"].shape[-1]
  if query[-1] % num_heads:
    raise PretrainedError(f"query kernel {query} is not divisible into "
                          f"{num_heads} heads.")
  fields.update(num_heads=num_heads, head_dim=query[-1] // num_heads,
                mlp_dim=mlp_dim, mlp_activations=activations,
                relpos_num_buckets=num_buckets)
  fields.update(overrides)
  return cls(**{k: (int(v) if isinstance(v, (np.integer,)) else v)
                for k, v in fields.items()})


# ----------------------------------------------------------------------------
# Recognising a checkpoint.

def _is_hf(path: pathlib.Path) -> bool:
  if not (path / hf_io.CONFIG_FILE).is_file():
    return False
  if not ((path / hf_io.SINGLE_FILE).is_file()
          or (path / hf_io.INDEX_FILE).is_file()):
    return False
  try:
    config = json.loads((path / hf_io.CONFIG_FILE).read_text())
  except ValueError:
    return False
  return bool(config.get("model_type") or config.get("architectures"))


def _is_t5x(path: pathlib.Path) -> bool:
  try:
    t5x_checkpoint.find_t5x_checkpoint(path)
    return True
  except FileNotFoundError:
    return False


def _orbax_item_dir(path: pathlib.Path, step: Optional[int]) -> pathlib.Path:
  """The orbax state item (`<step>/state` or a bare checkpoint)."""
  try:
    return checkpoint_files.state_item_dir(path, step)
  except checkpoint_files.NoCheckpointError as e:
    raise PretrainedError(str(e)) from None


def checkpoint_kind(path) -> str:
  """'huggingface', 't5x' or 'orbax', or PretrainedError saying what a
  checkpoint directory must hold."""
  path = pathlib.Path(path)
  if not path.exists():
    raise PretrainedError(f"Checkpoint path {path} does not exist.")
  if path.is_dir() and _is_hf(path):
    return HF
  if _is_t5x(path):
    return T5X
  if path.is_dir():
    try:
      _orbax_item_dir(path, None)
      return ORBAX
    except PretrainedError:
      pass
  raise PretrainedError(
      f"{path} is not a checkpoint jaxrlhf reads: expected a Hugging Face "
      "folder (config.json + model.safetensors or its index), a T5X "
      "checkpoint (checkpoint_<step>/checkpoint), or a jaxrlhf workdir / "
      "orbax checkpoint (checkpoints/<step>/state).")


# ----------------------------------------------------------------------------
# Placement.

def _device_tree(host_params, shardings):
  """Host arrays -> jax Arrays; with shardings, each device gets its slice
  (also across processes: every process holds the same host arrays)."""
  if shardings is None:
    return jax.tree.map(jnp.asarray, host_params)
  return jax.tree.map(
      lambda x, s: jax.make_array_from_callback(
          np.shape(x), s, lambda index, x=x: np.asarray(x[index])),
      host_params, shardings)


def _cast_floating(params, dtype):
  if dtype is None:
    return params
  return jax.tree.map(
      lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
      params)


def _to_host(params):
  params = nn.meta.unbox(params)
  if isinstance(params, flax.core.FrozenDict):
    params = flax.core.unfreeze(params)
  return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), params)


# ----------------------------------------------------------------------------
# The three sources.

def _replace(config, overrides):
  try:
    return family_lib.replace_fields(config, overrides)
  except ValueError as e:
    raise PretrainedError(str(e)) from None


def _load_hf(path, overrides):
  return hf_io.load_hf_checkpoint(path, **overrides)


def _load_t5x(path, model_config, overrides, mesh, rules):
  shapes = t5x_checkpoint.t5x_param_shapes(path)["params"]
  if model_config is None:
    config = infer_t5x_config(shapes, **overrides)
  else:
    config = _replace(model_config, overrides)
  module = module_for_config(config)
  if is_scanned(shapes, config) != bool(getattr(config, "scan_layers",
                                                 False)):
    # Another layout than the checkpoint's: read on the host, restack.
    host = t5x_checkpoint.read_t5x_checkpoint(
        path, restore_dtype=np.float32)["params"]
    host = relayout_params(host, config)
    return module, config, host, None
  check_param_tree(shapes, module, f"T5X checkpoint {path}")
  if mesh is None:
    host = t5x_checkpoint.read_t5x_checkpoint(
        path, restore_dtype=np.float32)["params"]
    return module, config, host, None
  shardings = param_shardings(module, mesh, rules)
  params = t5x_checkpoint.read_t5x_checkpoint(
      path, restore_dtype=np.float32, shardings=shardings)["params"]
  return module, config, None, params


def _find_run_config(item_dir: pathlib.Path):
  """The run's config.json (a ConfigDict with `model`) above an orbax item."""
  for parent in [item_dir] + list(item_dir.parents)[:4]:
    candidate = parent / "config.json"
    if candidate.is_file():
      try:
        data = json.loads(candidate.read_text())
      except ValueError:
        continue
      if isinstance(data, dict) and isinstance(data.get("model"), dict):
        return candidate, ml_collections.ConfigDict(data["model"])
  return None, None


def _policy_subtree(tree):
  """(path keys, subtree) of the policy parameters in an orbax tree."""
  if isinstance(tree, dict) and "params" in tree:
    params = tree["params"]
    if isinstance(params, dict) and "policy" in params:
      return ("params", "policy"), params["policy"]
    return ("params",), params
  return (), tree


def _embedding_rows(meta_params):
  for keys in (("token_embedder", "embedding"),
               ("decoder", "token_embedder", "embedding")):
    node = meta_params
    for k in keys:
      node = node.get(k) if isinstance(node, dict) else None
    if node is not None:
      return int(node.shape[0])
  raise PretrainedError("Cannot find the token embedding in the orbax "
                        "checkpoint to size the vocabulary; pass "
                        "model_config=.")


def _load_lora_orbax(item, spec, overrides):
  """(module, config, merged host params, None) of a LoRA run's policy."""
  record = lora.read_base_record(item)
  if not record or not record.get("checkpoint"):
    raise PretrainedError(
        f"{item} is a LoRA run's checkpoint, and its workdir names no base "
        f"checkpoint for its adapters ({lora.BASE_RECORD}: "
        f"{record or 'missing'}); a base that was a fresh initialisation is "
        "not saved.")
  _, base_config, base = from_pretrained(record["checkpoint"])
  _, model_cfg = _find_run_config(item)
  model_cfg.vocab_size = base_config.vocab_size
  _, config = registry.build_model(model_cfg, base_config.vocab_size)
  module = module_for_config(config)
  base = relayout_params(_to_host(base), config)
  swap = record.get("token_swap")
  base = token_rows.swap_token_rows(module, base,
                                    tuple(swap) if swap else None)
  lora.check_base(base, record, str(item), error=PretrainedError)
  adapters = checkpoint_files.restore_state_as_numpy(item)["params"]["policy"]
  host = lora.merged(base, adapters, spec)
  config = _replace(config, overrides)
  return module_for_config(config), config, relayout_params(host, config), None


def _load_orbax(path, model_config, overrides, mesh, rules, step):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  item = _orbax_item_dir(pathlib.Path(path), step)
  spec = lora.LoraSpec.from_config(
      (checkpoint_files.run_config(item) or {}).get("lora") or {})
  if spec is not None and model_config is None:
    return _load_lora_orbax(item, spec, overrides)
  tree = checkpoint_files.state_metadata(item)
  keys, meta = _policy_subtree(tree)
  if model_config is None:
    config_path, model_cfg = _find_run_config(item)
    if model_cfg is None:
      raise PretrainedError(
          f"No run config.json above {item} to build the model from; pass "
          "model_config= (e.g. t5.t5_config('small')).")
    vocab = _embedding_rows(meta)
    model_cfg.vocab_size = vocab
    _, config = registry.build_model(model_cfg, vocab)
    # The layout the run saved is the run's; overrides may change it.
    saved_config = config
  else:
    saved_config = model_config
  config = _replace(saved_config, overrides)
  module = module_for_config(config)
  saved_module = module_for_config(saved_config)
  check_param_tree(meta, saved_module, f"orbax checkpoint {item}")
  relayout = (getattr(saved_config, "scan_layers", False)
              != getattr(config, "scan_layers", False))
  if mesh is None or relayout:
    restore = jax.tree.map(
        lambda m: ocp.RestoreArgs(restore_type=np.ndarray), meta)
    target = jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), meta)
  else:
    shardings = param_shardings(saved_module, mesh, rules)
    target = jax.tree.map(
        lambda m, s: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=s),
        meta, shardings)
    restore = jax.tree.map(
        lambda t: ocp.ArrayRestoreArgs(sharding=t.sharding, dtype=t.dtype),
        target)
  for key in reversed(keys):
    target, restore = {key: target}, {key: restore}
  restored = checkpoint_files.restore_state(item, target, restore,
                                           partial=bool(keys))
  for key in keys:
    restored = restored[key]
  if mesh is None or relayout:
    return module, config, relayout_params(restored, config), None
  return module, config, None, restored


def from_pretrained(path, *, mesh=None, rules=None, dtype=None,
                    model_config=None, param_dtype=None,
                    step: Optional[int] = None, **overrides
                    ) -> Tuple[nn.Module, Any, Any]:
  """Loads a model and its parameters from a checkpoint (see module doc).

  Args:
    path: a Hugging Face folder, a T5X checkpoint, or a jaxrlhf workdir /
      orbax checkpoint.
    mesh: a `jax.sharding.Mesh`; parameters are placed on it by their
      logical axis names. None: the default device.
    rules: logical axis rules (default `jaxrlhf.sharding_rules.STANDARD_RULES`).
    dtype: the compute dtype to set in the model config (e.g. 'bfloat16');
      parameters stay float32 unless `param_dtype` says otherwise.
    model_config: the model config, for T5X checkpoints (else inferred from
      shapes) and orbax checkpoints without a run config.json.
    param_dtype: cast floating parameters to this dtype (e.g. jnp.bfloat16 to
      halve inference memory).
    step: for orbax checkpoints, the step to read (default the latest).
    **overrides: model config fields to set.
  Returns:
    (module, model_config, params): the Flax module, its config dataclass
    and the unboxed parameter tree of jax Arrays, for
    `module.apply({"params": params}, ...)`.
  Raises:
    PretrainedError: unknown checkpoint kind, or parameters that do not fit
      the model (naming each).
  """
  if dtype is not None:
    overrides["dtype"] = jnp.dtype(dtype).name
  if rules is None:
    rules = sharding_rules.STANDARD_RULES
  rules = sharding_lib.as_rules(rules)
  kind = checkpoint_kind(path)
  if kind == HF:
    if model_config is not None:
      raise PretrainedError("A Hugging Face folder carries its config.json; "
                            "pass overrides by keyword, not model_config.")
    config, host = _load_hf(path, dict(overrides))
    module, device = module_for_config(config), None
  elif kind == T5X:
    module, config, host, device = _load_t5x(path, model_config,
                                             dict(overrides), mesh, rules)
  else:
    module, config, host, device = _load_orbax(path, model_config,
                                               dict(overrides), mesh, rules,
                                               step)
  if host is not None:
    host = _to_host(host)
    check_param_tree(host, module, f"{kind} checkpoint {path}")
    shardings = None if mesh is None else param_shardings(module, mesh, rules)
    device = _device_tree(host, shardings)
  return module, config, _cast_floating(device, param_dtype)


def export_hf(module_or_config, params, path, **kwargs):
  """Writes a Hugging Face checkpoint (config.json + safetensors) that
  `transformers` loads. A LoRA policy (a base with its adapters beside the
  kernels, `lora.view`) is written merged: W + A . B * alpha / r.

  Args:
    module_or_config: a module (or its config) of a family with a Hugging
      Face mapping (scanned layouts are unstacked first).
    params: its parameters (boxed or not, host or device, sharded or not).
    path: output directory.
    **kwargs: `hf_io.export_hf_checkpoint` options: dtype ('float32',
      'bfloat16', 'float16'), max_shard_bytes, overwrite.
  Returns:
    The output directory.
  """
  config = getattr(module_or_config, "config", module_or_config)
  params = _to_host(params)
  if isinstance(params, dict) and set(params) == {"params"}:
    params = params["params"]
  if lora.has_adapters(params):
    # A LoRA policy as the run computes it (`Trainer.view`): merged.
    params = lora.merged(params, None)
  try:
    hf_io.config_to_hf(config)
  except hf_io.HFCheckpointError as e:
    raise PretrainedError(str(e)) from None
  return hf_io.export_hf_checkpoint(config, params, path, **kwargs)
