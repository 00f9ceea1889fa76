"""Pallas kernels: each one technique, each runnable on the CPU through the Pallas interpreter."""

from jaxaccel.model.kernels.flash import check_shapes, flash_attention, tile_schedule

__all__ = ["check_shapes", "flash_attention", "tile_schedule"]
