"""Deployment entrypoint: `flows/tokenize_recipe.py:tokenize_recipe` (deployments/prefect.yaml). The flow lives
in `sft_tokenize.flows.tokenize_recipe`; this file only names it, so Prefect loads the package's one copy."""

from sft_tokenize.flows.tokenize_recipe import tokenize_recipe

__all__ = ["tokenize_recipe"]
