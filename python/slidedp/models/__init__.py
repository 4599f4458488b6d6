"""HF model adapters (layer discovery, tied weights, masks) and the chunked LM loss."""
