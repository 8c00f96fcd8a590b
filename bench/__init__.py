"""Benchmarks, run as modules (python -m bench.train_step | sample | data_path | suite); see
docs/PERFORMANCE.md."""
