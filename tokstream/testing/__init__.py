"""Helpers the tests and the benchmarks share (a loopback S3 server, a trained BPE); not used by the converters or
training."""
