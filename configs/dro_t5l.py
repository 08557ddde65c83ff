"""DRO-V with a T5 1.1 Large policy and value on UltraFeedback, 40,000 steps
on a TPU v5e 4x4 slice (16 chips), as in the DRO paper.

Settings: see jaxrlhf.presets.ultrafeedback_offline.
"""

from jaxrlhf import presets


def get_config():
  return presets.ultrafeedback_offline("dro_v", "large", mesh_shape=(4, 4),
                                       num_steps=40_000)
