"""Layer 4, the step: loss and gradients, precision and loss scaling, optimizers, the train state,
compiled steps and their metrics."""
