"""The activation relay: stage workers serving a shard over TCP, the coordinator's remote chain,
and the local fleet of worker processes on this computer."""

# Groups of packed streams a remote chain keeps in flight at most; placement prices the relay with
# it too, and imports it from here, where nothing heavy comes along.
MAX_GROUPS = 8
