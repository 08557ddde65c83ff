"""Shared parts of recipes that train a policy against a frozen reference.

The policy and the reference both start from `config.init.policy_checkpoint`
(normally the SFT run); the reference stays fixed and is checkpointed with
the run. Evaluation samples completions from both on held-out prompts of
`config.eval.task` (default: the data task's own prompts are not used, since
offline data are typically the training prompts) and reports the win rate
against the reference judged by the task's gold reward, the mean gold reward,
KL(policy || reference) and mean length.

With `config.reference_logprobs.mode = "precomputed"` (recipes whose
`supports_precomputed_reference` is set) the reference is not part of the
train state: its log-probs are computed once over the training split
(`reference_cache`) and arrive with each batch, and evaluation loads the
reference from `config.init.policy_checkpoint` only while it runs.
"""

import os
from typing import Dict, Tuple

import jax
import jax.numpy as jnp
import seqio

from jaxrlhf import sharding
from jaxrlhf.data import alignment_data
from jaxrlhf.data import pipeline
from jaxrlhf.data import tasks
from jaxrlhf.eval import evaluation
from jaxrlhf.models import scoring
from jaxrlhf.recipes import base
from jaxrlhf.recipes import reference_cache
from jaxrlhf.train import metrics as metrics_lib
from jaxrlhf.train import pretrained


class PolicyRecipe(base.Recipe):
  """Policy + frozen reference; subclasses add their networks and loss."""

  # hook: the loss reads the reference only through `reference_logprobs` of
  # the data kind's own completion fields, each a function of its example
  # alone, so the values may be precomputed once over the training data.
  supports_precomputed_reference = False

  def __init__(self, config, mesh):
    if (config.reference_logprobs.mode == "precomputed"
        and not self.supports_precomputed_reference):
      raise ValueError(
          f"config.reference_logprobs.mode: 'precomputed' does not apply to "
          f"{config.algorithm!r}, whose reference log-probs depend on more "
          "than each example's own completion (KTO's KL baseline scores "
          "mismatched pairs that change with the batch; online recipes "
          "score fresh samples); use 'in_step'.")
    self._reference_table = None
    super().__init__(config, mesh)
    if self.precomputed_reference and isinstance(
        pipeline.get_task(config.data.task), seqio.Mixture):
      raise ValueError(
          f"config.data.task: {config.data.task!r} is a seqio mixture; "
          "precomputed reference log-probs need one pass that sees every "
          "training example, which a mixture's sampling does not promise. "
          "Train on a task, or use reference_logprobs.mode='in_step'.")
    self._check_eval_task()

  def _check_eval_task(self):
    """A named eval task must exist and have a gold reward; without one the
    run says once that it will not judge the policy."""
    cfg = self.config
    if cfg.eval.task:
      pipeline.get_task(cfg.eval.task, field="config.eval.task")
      if tasks.gold_reward_for(cfg.eval.task) is None:
        raise ValueError(
            f"config.eval.task: {cfg.eval.task!r} has no gold reward, which "
            "policy evaluation judges samples with. Register one with "
            "jaxrlhf.data.tasks.register_gold_reward, use a task that has "
            "one (e.g. 'synthetic_summarize'), or set it to '' to train "
            "without evaluation.")
    elif tasks.gold_reward_for(cfg.data.task) is None:
      metrics_lib.log(
          f"No evaluation: config.data.task {cfg.data.task!r} has no gold "
          "reward to judge the policy with; set config.eval.task to a task "
          "that has one (e.g. 'synthetic_summarize') to evaluate.")

  @property
  def precomputed_reference(self) -> bool:
    return self.config.reference_logprobs.mode == "precomputed"

  @property
  def reference_fields(self) -> Tuple[str, ...]:
    """The completion fields whose reference log-probs the loss reads."""
    return alignment_data.get_kind(self.data_kind).completion_fields

  def init_trainable(self, rng):
    return {"policy": self.init_lm(rng)}

  def init_frozen(self, rng):
    if self.precomputed_reference:
      return {}
    return {"reference": self.init_lm(rng)}

  def pretrained_paths(self):
    path = self.config.init.policy_checkpoint
    if not path:
      raise ValueError(
          f"config.init.policy_checkpoint: {self.config.algorithm} starts "
          "from a trained policy (usually the SFT run's workdir) and uses it "
          "as the reference; set the path.")
    if self.precomputed_reference:
      return {"params/policy": path}
    return {"params/policy": path, "frozen/reference": path}

  def sequence_logprobs(self, params, batch, names, rng=None):
    """{name: [batch] log pi(completion | prompt)} from one forward pass."""
    scored = scoring.score_many(self.lm, params, batch, names, rng=rng)
    return {n: jnp.sum(lp, axis=-1) for n, (lp, _) in scored.items()}

  def completion_lengths(self, batch, names):
    """{name: [batch] completion tokens (EOS included)}, any architecture."""
    suffix = ("decoder_loss_weights" if self.lm.is_encoder_decoder
              else "loss_weights")
    return {n: jnp.sum(batch[f"{n}_{suffix}"], axis=-1) for n in names}

  def reference_logprobs(self, frozen, batch, names):
    """{name: [batch] log pi_ref(completion | prompt)}: from the frozen
    reference, or, when precomputed, from the batch's `reference_logp_*`."""
    if self.precomputed_reference:
      missing = [n for n in names
                 if reference_cache.feature_name(n) not in batch]
      if missing:
        raise ValueError(
            f"config.reference_logprobs.mode='precomputed', but the batch has "
            f"no {[reference_cache.feature_name(n) for n in missing]}: read "
            "training batches from recipe.train_batches(), which adds them.")
      return {n: batch[reference_cache.feature_name(n)] for n in names}
    return jax.lax.stop_gradient(
        self.sequence_logprobs(frozen["reference"], batch, names))

  # --- precomputed reference log-probs ------------------------------------------

  def init_state(self):
    state = super().init_state()
    if self.precomputed_reference:
      # A new run's policy is the reference (both come from
      # pretrained_paths' "params/policy"): score with it rather than load
      # the checkpoint a second time.
      self._reference_table = self._reference_table_or_build(
          lambda: state.params["policy"], new_run=True)
    return state

  def train_batches(self, position: int):
    batches = super().train_batches(position)
    if not self.precomputed_reference:
      return batches
    if self._reference_table is None:
      self.prepare_reference_logprobs(new_run=False)
    return reference_cache.WithReferenceLogprobs(
        batches, self._reference_table,
        {f: reference_cache.scoring_features(self.lm, f)
         for f in self.reference_fields})

  def initial_policy_params(self):
    """The policy as a new run starts it (the reference), loaded afresh."""
    path = self.pretrained_paths().get("params/policy")
    if not path:
      return self._init(jax.random.PRNGKey(self.config.seed)).params["policy"]
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        self.abstract_state.params["policy"],
        self.state_shardings.params["policy"])
    return pretrained.load_lm_params(path, target)

  def reference_params(self, state):
    """The reference's parameters (loaded when precomputed mode keeps them
    out of the train state)."""
    if self.precomputed_reference:
      return self.initial_policy_params()
    return state.frozen["reference"]

  def reference_cache_dir(self) -> str:
    cfg = self.config.reference_logprobs
    if cfg.cache_dir:
      return cfg.cache_dir
    if self.workdir:
      return os.path.join(self.workdir, "reference_logprobs")
    raise ValueError(
        "config.reference_logprobs.cache_dir: unset, and this recipe was not "
        "given a workdir to put the precomputed reference log-probs in; set "
        "it to a directory.")

  def reference_fingerprint(self) -> Dict:
    """What the precomputed values depend on; a cache with another one is
    not reused."""
    cfg = self.config
    path = self.pretrained_paths().get("params/policy")
    return {
        "reference": (checkpoint_fingerprint(path) if path
                      else {"random_init_seed": cfg.seed}),
        "model": cfg.model.to_dict(),
        "task": cfg.data.task,
        "split": cfg.data.train_split,
        "data_files": cfg.data.files.to_dict(),
        "feature_lengths": dict(self.feature_lengths),
        "feature_converter": type(self.feature_converter).__name__,
        "completion_fields": list(self.reference_fields),
    }

  def prepare_reference_logprobs(self, new_run: bool):
    """Loads the precomputed reference log-probs, computing them first when
    the cache is absent, or stale in a new run (a stale cache of a resumed
    run is a CacheMismatchError). `init_state` and `train_batches` call it."""
    self._reference_table = self._reference_table_or_build(
        self.initial_policy_params, new_run=new_run)

  def _reference_table_or_build(self, reference_params, new_run: bool):
    """The cached table; built when absent, or when stale in a new run."""
    directory = self.reference_cache_dir()
    fingerprint = self.reference_fingerprint()
    try:
      table = reference_cache.load(directory, fingerprint)
    except reference_cache.CacheMismatchError as e:
      if not new_run:
        raise
      metrics_lib.log(f"{e} This is a new run, so it recomputes them.")
      table = None
    if table is not None:
      metrics_lib.log(
          f"Using {len(table)} precomputed reference log-probs from "
          f"{directory}")
      return table
    return self._build_reference_table(reference_params(), directory,
                                       fingerprint)

  def _build_reference_table(self, params, directory, fingerprint):
    cfg = self.config
    global_size = (cfg.reference_logprobs.batch_size
                   or cfg.train.batch_size // cfg.train.num_microbatches)
    dp = sharding.data_parallel_size(self.mesh, self.rules)
    if global_size % dp or global_size % jax.process_count():
      raise ValueError(
          f"config.reference_logprobs.batch_size: {global_size} rows cannot "
          f"be split over {dp} data-parallel shards and "
          f"{jax.process_count()} processes; use a multiple of both.")
    fields = self.reference_fields
    score_fn = jax.jit(
        lambda p, b: self.sequence_logprobs(p, b, fields),
        in_shardings=(self.state_shardings.params["policy"],
                      sharding.batch_sharding(self.mesh, self.rules, 1)),
        out_shardings=sharding.replicated(self.mesh))

    def score(local_batch):
      return score_fn(params, sharding.global_batch(local_batch, self.mesh,
                                                    self.rules))

    batches = pipeline.BatchIterator(
        cfg.data.task, cfg.data.train_split, self.feature_lengths,
        self.feature_converter, global_size, seed=cfg.seed, shuffle=False,
        num_epochs=1, drop_remainder=False)
    # Only for progress lines; a source may not know its size.
    total = pipeline.get_task(cfg.data.task).num_input_examples(
        cfg.data.train_split)
    metrics_lib.log(f"Precomputing reference log-probs of {cfg.data.task}:"
                    f"{cfg.data.train_split} into {directory}")
    keys, logprobs = reference_cache.compute(
        batches, pipeline.local_batch_size(global_size), score,
        {f: reference_cache.scoring_features(self.lm, f) for f in fields},
        total_examples=total)
    reference_cache.write(directory, fingerprint, keys, logprobs)
    return reference_cache.load(directory, fingerprint)

  # --- evaluation --------------------------------------------------------------

  def _eval_prompts(self):
    if not hasattr(self, "_prompts"):
      cfg = self.config
      task = cfg.eval.task or cfg.data.task
      if tasks.gold_reward_for(task) is None:
        self._prompts = None
        return None
      features, texts = pipeline.eval_examples(
          task, cfg.eval.split, {"inputs": cfg.data.inputs_length,
                                 "targets": cfg.data.targets_length},
          seqio.EncDecFeatureConverter(pack=False), cfg.eval.num_examples)
      self._prompts = (features["encoder_input_tokens"],
                       [t["inputs"] for t in texts], tasks.gold_reward_for(task))
    return self._prompts

  def evaluation_description(self) -> str:
    e = self.config.eval
    return (f"{e.num_examples} held-out prompts x {e.num_samples} samples at "
            f"temperature {e.temperature:g}, against the reference's")

  def evaluate(self, state) -> Dict[str, float]:
    prompts = self._eval_prompts()
    if prompts is None:
      return {}
    tokens, texts, gold = prompts
    return evaluation.compare_with_reference(
        self, state.params["policy"], self.reference_params(state), tokens,
        texts, gold, num_samples=self.config.eval.num_samples,
        temperature=self.config.eval.temperature, seed=self.config.seed)


def checkpoint_fingerprint(path: str) -> Dict[str, str]:
  """A checkpoint path and the step directory it resolves to (a workdir or
  T5X model directory means its latest step, which may move on)."""
  path = os.path.abspath(os.fspath(path))
  return {"path": path,
          "resolved": os.path.abspath(pretrained.resolve_checkpoint(path))}
