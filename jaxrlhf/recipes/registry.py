"""config.algorithm -> recipe class (jaxrlhf.defaults.ALGORITHMS lists the
same names for config validation)."""

from jaxrlhf.recipes import direct_preference
from jaxrlhf.recipes import dro
from jaxrlhf.recipes import kto
from jaxrlhf.recipes import reward_model
from jaxrlhf.recipes import sft

RECIPES = {
    "sft": sft.SFTRecipe,
    "reward_model": reward_model.RewardModelRecipe,
    "dpo": direct_preference.DirectPreferenceRecipe,
    "kto": kto.KTORecipe,
    "kto_thumbs": kto.KTOThumbsRecipe,
    "dro_v": dro.DROVRecipe,
}
