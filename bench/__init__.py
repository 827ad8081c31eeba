"""Benchmarks that print ratios against direct llama.cpp and peers (see bench/README.md)."""
