"""Deployment entrypoint: `flows/tokenize_dataset.py:tokenize_dataset` (deployments/prefect.yaml, and
`prefect flow-run retry … --entrypoint`). The flow lives in `sft_tokenize.flows.tokenize_dataset`; this file
only names it, so Prefect loads the package's one copy of it."""

from sft_tokenize.flows.tokenize_dataset import tokenize_dataset

__all__ = ["tokenize_dataset"]
