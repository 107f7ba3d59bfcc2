"""Reading checkpoints from disk: a directory, a Hub id in the local cache, or a GGUF
file (its metadata, tensors and tokenizer). Nothing is ever downloaded."""
