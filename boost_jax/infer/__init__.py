"""Using a trained run: load a checkpoint for use (load.py), decode with a KV cache (decode.py)."""
