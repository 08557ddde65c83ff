"""DPO on UltraFeedback pairs (best vs. a random worse completion) from a T5X
SFT checkpoint, T5 1.1 Large on a v5e 4x4 slice.

`--config.dpo.loss_type=ipo|slic|cdpo|robust_dpo` selects the other members
of the family (configs/ipo.py and configs/slic.py set their usual betas).
"""

from jaxrlhf import presets


def get_config(loss_type: str = "dpo"):
  c = presets.ultrafeedback_offline("dpo", "large", mesh_shape=(4, 4),
                                    num_steps=20_000)
  c.dpo.loss_type = loss_type
  c.dpo.beta = 0.1
  return c
