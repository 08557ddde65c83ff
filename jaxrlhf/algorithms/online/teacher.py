"""A frozen teacher's next-token distributions as what the student learns:
on-policy distillation (`algorithm='distill'`, or a term any online
algorithm adds) and GKD (`algorithm='gkd'`); the algorithms themselves are
in `distill`.

The teacher (`distill.teacher_checkpoint`) is any family we load, at any
size, of the student's vocabulary (`learned_reward.build`, the way a
reward model is built): a frozen network of the run, on the same mesh and
sharded by the same rules as the policy. Two uses of it:

  advantage  (Thinking Machines' on-policy distillation, and its GRPO
             mix) the teacher scores the sampled tokens, and each token's
             advantage gains -coef * (log pi_student - log pi_teacher), the
             per-token sampled estimate of the reverse KL, discounted by
             nothing (each token answers for itself); an algorithm with
             rewards adds it to the advantages of its rewards, so both
             signals train the policy.
  loss       coef x the generalised Jensen-Shannon divergence between the
             student's and the teacher's distributions over the whole
             vocabulary at every response token (`losses.distillation`;
             reverse KL, beta 1, unless GKD's beta says otherwise), formed
             a chunk of positions at a time (`scoring.logits_chunk`, as the
             SFT loss chunks them) and added to the algorithm's loss. It
             runs the student once more on each minibatch (the algorithm's
             own loss reads log-probs of the sampled tokens only).

`distill` is the online step with no rewards: its only signal is the
teacher's. `gkd` (Agarwal et al. 2024, GKD, Algorithm 1) is the loss mode
on a mix of the student's samples and the dataset's completions: each
step, with probability `gkd.lmbda` the student samples the batch's
responses, else the step trains on the prompts' own targets (TRL's
GKDTrainer draws once per batch the same way); its divergence is
JSD(`gkd.beta`). Both log-probs and distributions are at
`online.temperature`, which divides both models' logits (TRL's GKD
`temperature`, default 0.9 there).
"""

from typing import Any, Dict, Optional

import jax
import jax.numpy as jnp

from jaxrlhf import config_schema
from jaxrlhf.algorithms import lora_state
from jaxrlhf.algorithms.online import reward_sources
from jaxrlhf.data import prompts as prompts_lib
from jaxrlhf.losses import distillation
from jaxrlhf.models import sampling
from jaxrlhf.models import scoring
from jaxrlhf.rewards import learned_reward
from jaxrlhf.rl import rollout as rollout_lib

F = config_schema.Field

TEACHER = "teacher"
MODES = ("advantage", "loss")
# The algorithms whose only signal is the teacher's (`distill`).
DISTILL, GKD = "distill", "gkd"

GROUP = config_schema.Group(
    "distill", "A frozen teacher the student learns from: "
    "algorithm='distill' or 'gkd', or a term any online algorithm adds "
    "when teacher_checkpoint is set (jaxrlhf/algorithms/online/teacher.py).",
    [
        F("teacher_checkpoint", "",
          "The teacher: a jaxrlhf run's workdir (its latest params/policy, "
          "built with its own model config) or a Hugging Face folder; any "
          "family and size, of the student's vocabulary. Required by "
          "distill and gkd; set with another online algorithm, it adds "
          "the distillation term to that algorithm's signal.", path=True,
          read_when=lambda c: bool(c.distill.teacher_checkpoint)),
        F("coef", 1.0,
          "The weight of the distillation term: of the per-token advantage "
          "-(log pi_student - log pi_teacher) (mode 'advantage') or of the "
          "divergence in the loss (mode 'loss').", bounds=">0"),
        F("mode", "advantage",
          "'advantage': the teacher scores the sampled tokens and the "
          "sampled reverse KL is a per-token negative advantage (Thinking "
          "Machines' on-policy distillation); 'loss': the divergence over "
          "the whole vocabulary at every response token is added to the "
          "loss (reverse KL; gkd: JSD(gkd.beta), and gkd always uses "
          "'loss').", choices=MODES),
        F("teacher_dtype", "model",
          "How the frozen teacher is held: 'model' = in its model's dtype, "
          "the precision its forward pass reads (bfloat16 halves its "
          "memory; its projections cast their kernels to it anyway, so "
          "only parameters read in float32, such as norm scales, round), "
          "or 'float32'.", choices=lora_state.BASE_DTYPES),
        F("teacher_size", "",
          "A preset of config.model.arch for the teacher when its "
          "checkpoint has no model config to read (a plan of a run whose "
          "teacher is not on this machine); '' = the student's size.",
          read_when=lambda c: bool(c.distill.teacher_checkpoint)),
    ])

GKD_GROUP = config_schema.Group(
    "gkd", "Generalised knowledge distillation (algorithm='gkd'; the "
    "teacher is distill.teacher_checkpoint).", [
        F("beta", 0.5,
          "The generalised JSD's beta (TRL's convention): 0 forward "
          "KL(teacher || student), 1 reverse KL(student || teacher), "
          "between them the mixture (TRL: 0.5).", bounds="[0, 1]"),
        F("lmbda", 0.5,
          "The share of steps whose responses the student samples; the "
          "others train on the dataset's completions (the task's targets) "
          "(TRL: 0.5; 1 = on-policy only, 0 = supervised KD).",
          bounds="[0, 1]"),
    ])


def active(config) -> bool:
  """Whether the run has a teacher."""
  return bool(config.distill.teacher_checkpoint)


def mode(config) -> str:
  """How the teacher's signal trains (`MODES`): GKD's is always the loss."""
  return "loss" if config.algorithm == GKD else config.distill.mode


def beta(config) -> float:
  """The divergence's beta: GKD's, else 1 (reverse KL)."""
  return float(config.gkd.beta) if config.algorithm == GKD else 1.0


def check_distill(c) -> None:
  """What distillation needs: a teacher where the algorithm is one, and a
  driver that scores with it."""
  if c.algorithm in (DISTILL, GKD):
    config_schema.require(
        active(c), "distill.teacher_checkpoint",
        f"{c.algorithm} learns from a teacher; set it to a jaxrlhf run's "
        "workdir or a Hugging Face folder of the student's vocabulary.")
  if not active(c):
    return
  o = c.online
  config_schema.require(
      not o.environment and not o.tools, "distill.teacher_checkpoint",
      "a teacher does not yet score multi-turn episodes "
      "(online.environment / online.tools); leave one of them unset.")
  config_schema.require(
      not o.sampler_devices and not o.off_policy_steps,
      "distill.teacher_checkpoint",
      "a teacher does not yet score rollouts made on sampler devices "
      "(online.sampler_devices, online.off_policy_steps); unset them.")
  config_schema.require(
      c.algorithm != "rejection_sampling", "distill.teacher_checkpoint",
      "rejection sampling trains on its chosen samples without "
      "advantages; distil with distill, gkd or a policy-gradient "
      "algorithm.")


# --- the teacher's network -------------------------------------------------------


def build_teacher(config, vocabulary, platform: str, shapes_only: bool
                  ) -> Optional[learned_reward.FrozenNetwork]:
  """The teacher's network (its vocabulary checked against the student's),
  or None without one."""
  if not active(config):
    return None
  fallback = config.model
  if config.distill.teacher_size:
    fallback = config.model.copy_and_resolve_references()
    fallback.size = config.distill.teacher_size
  return learned_reward.build(
      config.distill.teacher_checkpoint, "config.distill.teacher_checkpoint",
      vocabulary, fallback, platform, check_vocabulary=not shapes_only,
      what="the teacher",
      fix="Distil from a teacher of the student's vocabulary.")


def describe(config, teacher: learned_reward.FrozenNetwork) -> str:
  """"Teacher: <path> (a LlamaConfig of emb_dim 64), per-token advantage
  x 1", for the console at start-up."""
  use = {"advantage": "per-token advantage",
         "loss": f"JSD(beta={beta(config):g}) in the loss"}[mode(config)]
  return (f"Teacher: {teacher.path} (a {type(teacher.model_config).__name__}"
          f" of emb_dim {teacher.model_config.emb_dim}), {use} x "
          f"{config.distill.coef:g}")


def frozen_networks(trainer, rng) -> Dict[str, Any]:
  """{"teacher": fresh (boxed) params} when the run has a teacher."""
  teacher = trainer.online.teacher
  if teacher is None:
    return {}
  params = trainer.init_lm(rng, module=teacher.adapter.module)
  if trainer.config.distill.teacher_dtype == "model":
    dtype = jnp.dtype(teacher.model_config.dtype)
    params = jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating)
        else x, params)
  return {TEACHER: params}


def loaded_networks(teacher, abstract_state, token_swap) -> Dict[str, Any]:
  """{"frozen/teacher": its checkpoint's params}, shaped and sharded as in
  `abstract_state` (`teacher`: the run's, or None); `token_swap` as in
  `reward_sources.load_frozen_lm`."""
  if teacher is None:
    return {}
  return {f"frozen/{TEACHER}": reward_sources.load_frozen_lm(
      teacher, abstract_state, f"frozen/{TEACHER}",
      "config.distill.teacher_checkpoint", token_swap)}


# --- the teacher on a rollout ----------------------------------------------------


def teacher_features(trainer, prompt_tokens, rollout):
  """The rollout's responses laid out for the teacher's architecture: the
  student's features when it is the student's."""
  teacher_lm = trainer.online.teacher.adapter
  if teacher_lm.is_encoder_decoder == trainer.lm.is_encoder_decoder:
    return rollout.features
  tokens = rollout_lib.response_tokens(trainer.lm, rollout.features,
                                      rollout.mask.shape[1])
  return rollout_lib.response_features(
      teacher_lm, prompt_tokens, tokens, rollout.mask,
      trainer.vocabulary.eos_id)


def score_with_teacher(trainer, teacher_params, prompt_tokens, rollout):
  """The rollout with the teacher's log-probs of its tokens at the sampling
  temperature (`teacher_logprobs`) and, when the teacher's architecture
  is not the student's, its features (`teacher_features`). prompt_tokens:
  [rows, Lp], a row's prompt per response."""
  features = teacher_features(trainer, prompt_tokens, rollout)
  length = rollout.mask.shape[1]
  logprobs, _, _ = rollout_lib.logprobs_and_entropy(
      trainer.online.teacher.adapter, teacher_params, features, None,
      trainer.config.online.temperature, length)
  return rollout.replace(
      teacher_logprobs=jax.lax.stop_gradient(logprobs) * rollout.mask,
      teacher_features=None if features is rollout.features else features)


def with_distill_targets(config, teacher, rollout, rows, metrics):
  """The update rows with what the teacher adds (mode 'advantage': the
  per-token advantage; 'loss': the teacher's features when they are not
  the student's), and the rollout's `distill/reverse_kl`: the sampled
  estimate sum_t (log pi_student - log pi_teacher) / tokens. Nothing
  without a teacher (`teacher`: the run's, or None)."""
  if teacher is None:
    return rows, metrics
  gap = (rollout.logprobs - rollout.teacher_logprobs) * rollout.mask
  tokens = jnp.maximum(jnp.sum(rollout.mask), 1.0)
  metrics = dict(metrics, **{"distill/reverse_kl": jnp.sum(gap) / tokens})
  if mode(config) == "advantage":
    advantages = rows["advantages"]
    if advantages.ndim == 1:
      advantages = advantages[:, None]
    advantages = advantages - config.distill.coef * gap
    rows = dict(rows, advantages=advantages)
    if "advantage_abs_mean" in metrics:  # the targets' own, now with it
      metrics["advantage_abs_mean"] = jnp.sum(
          jnp.abs(advantages) * rollout.mask) / tokens
  elif rollout.teacher_features is not None:
    rows = dict(rollout.teacher_features, **rows)
  return rows, metrics


def with_distill_loss(trainer, loss_fn, frozen):
  """`loss_fn` (params, minibatch) -> (loss, metrics) plus, in mode 'loss',
  coef x the divergence to the teacher (its params in `frozen`) over the
  vocabulary at each response token (`distill/divergence` in the
  metrics)."""
  if trainer.online.teacher is None or mode(trainer.config) != "loss":
    return loss_fn
  config = trainer.config
  coef, beta_ = config.distill.coef, beta(config)
  length = trainer.online.response_length
  teacher_lm = trainer.online.teacher.adapter

  def loss(params, minibatch):
    value, metrics = loss_fn(params, minibatch)
    mask = minibatch["response_mask"]
    viewed, viewed_frozen = trainer.view_parts(params, frozen)  # LoRA
    student, project_student = trainer.lm.response_states(
        viewed["policy"], minibatch, length,
        routes=minibatch.get(rollout_lib.ROUTES))
    teacher, project_teacher = teacher_lm.response_states(
        viewed_frozen[TEACHER], minibatch, length)
    teacher = jax.lax.stop_gradient(teacher)
    vocab = jax.eval_shape(project_student, student[:, :1]).shape[-1]
    divergence = distillation.generalized_jsd_from_hidden(
        project_student, student, project_teacher, teacher, mask, beta_,
        config.online.temperature,
        chunk=scoring.logits_chunk(2 * mask.shape[0], vocab))
    metrics = dict(metrics, **{"distill/divergence": divergence})
    return value + coef * divergence, metrics

  return loss


# --- GKD's responses -----------------------------------------------------------


def _dataset_samples(completions, eos) -> sampling.Samples:
  """The prompts' own completions [P * k, L] (ending at the EOS id `eos`)
  as samples: no sampler log-probs (NaN, so the sampler's gap metrics are
  left out)."""
  mask = (jnp.cumsum(completions == eos, axis=1)
          - (completions == eos)) == 0
  mask = (mask & (completions != 0)).astype(jnp.float32)
  return sampling.Samples(
      tokens=completions, logprobs=jnp.full(mask.shape, jnp.nan),
      mask=mask, has_eos=jnp.any(completions == eos, axis=1),
      num_steps=jnp.int32(completions.shape[1]))


def gkd_sample(trainer, sample_fn, params, frozen, prompts, key):
  """GKD's responses: the student's samples with probability gkd.lmbda,
  else the dataset's completions (one draw per step)."""
  coin, key = jax.random.split(key)
  completions = jnp.repeat(prompts[prompts_lib.COMPLETIONS],
                           trainer.online.samples_per_prompt, axis=0)
  on_policy = jax.random.uniform(coin) < trainer.config.gkd.lmbda
  sampled = jax.eval_shape(lambda: sample_fn(params, frozen, prompts, key))

  def dataset():
    samples = _dataset_samples(completions, trainer.vocabulary.eos_id)
    if sampled.preemptions is not None:  # no engine ran: none preempted
      samples = samples.replace(preemptions=jnp.int32(0))
    if sampled.routes is None:
      return samples
    # Router replay: no sampler routed the dataset's tokens; -1 lets the
    # trainer route them itself.
    return samples.replace(routes=jnp.full(sampled.routes.shape, -1,
                                           sampled.routes.dtype))
  return jax.lax.cond(
      on_policy, lambda: sample_fn(params, frozen, prompts, key), dataset)
