"""Running one shard: the stateful, paged and static stage runners, the factory that picks one,
packed forwards, the last stage's output, and the in-process chain."""
