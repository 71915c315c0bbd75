"""Running a model's shards: ``stages`` (one compiled shard, and chains of them in process),
``relay`` (stages in other processes over TCP) and ``decode`` (generation, speculation, sampling
and the multi-user chat service over any chain).  ``interfaces`` declares what they share."""
