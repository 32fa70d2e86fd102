"""One module per `pitstop` command: each has `register(subparsers)`, which adds its flags,
and `run(args) -> exit code`, which calls the library and prints. `pitstop.cli` lists them.

A command module imports torch-free library modules at module level; modules that load
torch or transformers are imported inside `run`, so `pitstop --help` and a configuration
error stay fast (see docs/architecture.md).
"""
