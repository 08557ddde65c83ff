"""Offline algorithms: a loss over batches of a fixed dataset.

`training.Offline` is their `Training` (one gradient update per batch);
each other module here is one algorithm (SFT, the reward model, the DPO
family, KTO, BCO, DRO-V) ending in its `ALGORITHM`. `precomputed_reference`
and `reference_cache` hold the frozen reference's log-probs computed once
per dataset instead of every step.
"""
