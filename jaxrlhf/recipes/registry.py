"""config.algorithm -> recipe class (jaxrlhf.defaults.ALGORITHMS lists the
same names for config validation)."""

from jaxrlhf.recipes import direct_preference
from jaxrlhf.recipes import dro
from jaxrlhf.recipes import group_rl
from jaxrlhf.recipes import kto
from jaxrlhf.recipes import ppo
from jaxrlhf.recipes import rejection_sampling
from jaxrlhf.recipes import reward_model
from jaxrlhf.recipes import sft

RECIPES = {
    "sft": sft.SFTRecipe,
    "reward_model": reward_model.RewardModelRecipe,
    "reward_model_ranking": reward_model.RankingRewardModelRecipe,
    "dpo": direct_preference.DirectPreferenceRecipe,
    "kto": kto.KTORecipe,
    "kto_thumbs": kto.KTOThumbsRecipe,
    "dro_v": dro.DROVRecipe,
    "ppo": ppo.PPORecipe,
    "rloo": group_rl.RLOORecipe,
    "grpo": group_rl.GRPORecipe,
    "reinforce": group_rl.ReinforceRecipe,
    "rejection_sampling": rejection_sampling.RejectionSamplingRecipe,
}
