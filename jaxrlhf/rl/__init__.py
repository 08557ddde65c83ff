"""The pure-function core of online RL for language models.

Modules:
  rollout_rewards  EOS truncation, score at the last token, EOS penalty.
  kl               per-token KL estimators (k1/k2/k3), KL-penalised rewards,
                   the adaptive KL controller.
  advantages       GAE, reward/advantage whitening, RLOO, GRPO, REINFORCE,
                   REINFORCE++.
  reductions       per-sequence / token / constant-length loss reductions.
  ppo_losses       PPO rollout targets, clipped policy and value losses.
  policy_gradient_losses  the clipped policy-gradient loss of RLOO, REINFORCE and
                   GRPO (k3 KL term in the loss, asymmetric clipping).
  best_of_n        best-of-N / rejection-sampling selection, best-of-N KL.

Every function is a jit-compatible function of arrays; string and integer
options are static (pass them with `static_argnames` or close over them).
"""

from jaxrlhf.models.scoring import entropy_from_logits
from jaxrlhf.rl.advantages import batch_mean_baseline
from jaxrlhf.rl.advantages import generalized_advantage_estimation
from jaxrlhf.rl.advantages import grpo_advantages
from jaxrlhf.rl.advantages import reinforce_advantages
from jaxrlhf.rl.advantages import reinforce_pp_advantages
from jaxrlhf.rl.advantages import rloo_advantages
from jaxrlhf.rl.advantages import update_running_mean
from jaxrlhf.rl.advantages import whiten_advantages
from jaxrlhf.rl.advantages import whiten_rewards
from jaxrlhf.rl.best_of_n import best_of_n_kl
from jaxrlhf.rl.best_of_n import gather_per_prompt
from jaxrlhf.rl.best_of_n import top_k_overall
from jaxrlhf.rl.best_of_n import top_per_prompt
from jaxrlhf.rl.kl import adaptive_kl_coef
from jaxrlhf.rl.kl import kl_estimate
from jaxrlhf.rl.kl import kl_penalized_sequence_rewards
from jaxrlhf.rl.kl import per_token_rewards
from jaxrlhf.rl.kl import sequence_kl
from jaxrlhf.rl.policy_gradient_losses import clipped_policy_gradient_loss
from jaxrlhf.rl.ppo_losses import clipped_surrogate
from jaxrlhf.rl.ppo_losses import explained_variance
from jaxrlhf.rl.ppo_losses import ppo_loss
from jaxrlhf.rl.ppo_losses import ppo_policy_loss
from jaxrlhf.rl.ppo_losses import ppo_rollout_targets
from jaxrlhf.rl.ppo_losses import ppo_value_loss
from jaxrlhf.rl.reductions import reduce_token_losses
from jaxrlhf.rl.rollout_rewards import last_token_index
from jaxrlhf.rl.rollout_rewards import replace_score_without_eos
from jaxrlhf.rl.rollout_rewards import score_at_last_token
from jaxrlhf.rl.rollout_rewards import truncate_after_eos
