"""Fleet operations: node agents, discovery, profiles, placement and deployment."""
