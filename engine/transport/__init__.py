"""How fleet processes talk: the wire protocol (``wire``) and the connections that carry it (``link``).

The activation relay and the fleet's control API both use it; neither reaches into the other.
"""
