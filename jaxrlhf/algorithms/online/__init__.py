"""Online RL: algorithms that learn from the policy's own samples.

  iteration      the step, prompts -> sample -> score -> rewards ->
                 advantages -> updates, and its named parts
  recipe         `Online`, the `Training` every online algorithm shares
  host_split     the driver that runs the step's parts around the host
                 (rewards computed by programs, dynamic sampling)
  overlap        the driver that samples on devices of their own, one step
                 ahead
  reward_sources the run's rewards (reward model, gold reward, programs)
  options        the `online` config group and its checks
  kl_control     the KL coefficient, fixed or adaptive
  critic_free    what RLOO, GRPO and REINFORCE share
  ppo, rloo, grpo, reinforce, reinforce_pp, rejection_sampling
                 the algorithms, each ending in its `ALGORITHM`
"""
