"""Benchmarks behind `fleet bench`: each measures our chains against a peer side by side and writes
one report (``report``)."""
