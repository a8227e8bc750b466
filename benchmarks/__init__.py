"""Benchmarks and load-testing clients: outside the runtime (`jaxllm/`) and the server (`serving/`)."""
