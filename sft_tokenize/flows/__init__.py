"""The Prefect flows that build a cache and a recipe, the runners they run on, and what they report."""
