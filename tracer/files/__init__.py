"""Model files on disk: sources, conversion, the cache's hashes, weights, tokenizers, GGUF and tensor files."""
