"""The activation relay: stage workers serving a shard over TCP, the coordinator's remote chain,
and the local fleet of worker processes on this computer."""
