"""Training data: JSONL sequences, padding, labels."""
