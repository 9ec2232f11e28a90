"""Benchmarking, in one installed home: the libraries behind `kiln bench` (generation on the
CPU and the GPU, the server under concurrent clients) and the measurement scripts that
print side-by-side tables (the serving ceiling, trigger latencies, the GPU static-KV
prototype). Speed is measured here, never by a timed test.

Benchmarks may import any room; no room imports them (only `kiln bench`'s verbs in
flows/cli.py, inside the verbs), so nothing a benchmark loads reaches the pipeline or the
server.
"""
