"""Layer 7, what a trained run gives: samples and exported weights."""
