"""Layer 6, the run: its config, the training loop, checkpoints, trackers, profiling."""
