"""The activation relay: stage workers serving a shard over TCP, the coordinator's remote chain,
and the local fleet of worker processes on this computer.  What a relay runs with (groups in flight,
a prompt's rows, the heartbeat) is ``engine.config.RelayOptions``."""
