"""The shared vocabulary, imported by every side and importing nothing of the package
outside this folder: metric keys, `ConfigError`, vLLM's truncation rule, files that survive a
kill -9, ports, thread counts, log filters, and the watchdog that ends a job's own Ray."""
