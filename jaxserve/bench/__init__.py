"""Benchmarks behind `jaxserve bench`."""
