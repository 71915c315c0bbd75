"""Decoding over any chain: the generation loop, speculative drafts, sampling, tokenization, stop
strings and the multi-user chat service."""
