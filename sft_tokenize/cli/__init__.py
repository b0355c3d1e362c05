"""The `sft-tokenize` command line: its entry point, its arguments, and the resident process that runs a command."""
