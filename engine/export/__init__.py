"""Exporting a model into per-stage OpenVINO shards: trace each stage, convert, make it stateful,
compress its weights."""
