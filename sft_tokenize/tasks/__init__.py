"""Prefect tasks, one module per task, each a thin wrapper over its plain function in `sft_tokenize`."""
