"""``shardkit.ModelEMA``: an exponential moving average of model weights, one fused
multi-tensor update per step (:mod:`~shardkit.ema.model_ema`), optionally kept in host
memory behind non-blocking copies (:mod:`~shardkit.ema.stage`)."""

from shardkit.ema.model_ema import ModelEMA

__all__ = ["ModelEMA"]
