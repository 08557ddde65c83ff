"""IPO (Azar et al. 2023) on UltraFeedback pairs; see configs/dpo.py."""

from jaxrlhf import presets


def get_config():
  c = presets.ultrafeedback_offline("dpo", "large", mesh_shape=(4, 4),
                                    num_steps=20_000)
  c.dpo.loss_type = "ipo"
  c.dpo.beta = 1.0  # IPO's tau
  return c
