"""The ad-hoc runs' embedded Prefect server: its process, state, schema, fork and busy retry, and the finder of
resident processes. It imports the package's base only: the flows start it, the command line shows and stops it."""
