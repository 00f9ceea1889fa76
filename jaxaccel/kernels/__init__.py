"""Pallas kernels: each one technique, each runnable on the CPU through the Pallas interpreter."""

from jaxaccel.kernels.flash import flash_attention, tile_schedule

__all__ = ["flash_attention", "tile_schedule"]
