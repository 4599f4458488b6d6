"""The layer-streaming engine: device window, step loop, lanes, training loop."""
