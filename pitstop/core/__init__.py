"""The ground floor: what every other package may import (errors, logging, atomic
writes, the run configuration and record, locks, versions). It imports nothing of
pitstop above it (tests/test_import_graph.py; docs/architecture.md)."""
