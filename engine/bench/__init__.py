"""Benchmarks behind `fleet bench`: each measures our chains against a peer side by side and writes
one report (``report``); ``registry`` defines each one once, for the command line and the app."""
