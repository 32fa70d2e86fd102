"""The ground floor's top: what every other package may import (logging, atomic writes,
the run configuration and record, locks, versions, and the errors under their usual
path). It imports only the two floors below it, `pitstop.errors` and the catalogue
(`pitstop.catalog`), and nothing above (tests/test_import_graph.py; docs/architecture.md)."""
