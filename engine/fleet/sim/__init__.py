"""A simulated office on this Linux machine (``fleet sim``, the tests' fixture, ``fleet bench sim``):
``office`` (PCs as network namespaces, each with its own node agent) and ``netns`` (the Linux
plumbing under it: namespaces, bridge, veth pairs, tc and cgroups)."""
