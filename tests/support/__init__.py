"""What the test files share and pytest does not need as fixtures: paths, tokenizers of real chat-template
families, conversations, the mask oracle, and one harness for running the CLI and Prefect in subprocesses.

tests/ is on pytest's pythonpath, so test files import these as `support.<module>`."""
