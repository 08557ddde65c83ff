"""Shared parts of recipes that train a policy against a frozen reference.

The policy and the reference both start from `config.init.policy_checkpoint`
(normally the SFT run); the reference stays fixed and is checkpointed with
the run. Evaluation samples completions from both on held-out prompts of
`config.eval.task` (default: the data task's own prompts are not used, since
offline data are typically the training prompts) and reports the win rate
against the reference judged by the task's gold reward, the mean gold reward,
KL(policy || reference) and mean length.
"""

from typing import Dict

import jax
import jax.numpy as jnp
import seqio

from jaxrlhf.data import pipeline
from jaxrlhf.data import tasks
from jaxrlhf.eval import evaluation
from jaxrlhf.models import scoring
from jaxrlhf.recipes import base


class PolicyRecipe(base.Recipe):
  """Policy + frozen reference; subclasses add their networks and loss."""

  def init_trainable(self, rng):
    return {"policy": self.init_lm(rng)}

  def init_frozen(self, rng):
    return {"reference": self.init_lm(rng)}

  def pretrained_paths(self):
    path = self.config.init.policy_checkpoint
    if not path:
      raise ValueError(
          f"config.init.policy_checkpoint: {self.config.algorithm} starts "
          "from a trained policy (usually the SFT run's workdir) and uses it "
          "as the reference; set the path.")
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
    return jax.lax.stop_gradient(
        self.sequence_logprobs(frozen["reference"], batch, names))

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

  def evaluate(self, state) -> Dict[str, float]:
    prompts = self._eval_prompts()
    if prompts is None:
      return {}
    tokens, texts, gold = prompts
    return evaluation.compare_with_reference(
        self, state.params["policy"], state.frozen["reference"], tokens, texts,
        gold, num_samples=self.config.eval.num_samples,
        temperature=self.config.eval.temperature, seed=self.config.seed)
