"""Helpers the tests and the benchmarks share (a loopback S3 server); not used by the converters or training."""
