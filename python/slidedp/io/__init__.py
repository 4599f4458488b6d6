"""HF safetensors load into the host store, and HF export of the master weights."""
