"""The Prefect flow that builds a tokenized SFT cache, and the `sft-tokenize` command line."""
