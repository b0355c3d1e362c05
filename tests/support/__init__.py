"""What the test files share and pytest does not need as fixtures: paths, tokenizers of real chat-template
families, conversations, the mask oracle, what a run leaves on disk, flow runs on the test harness, one harness
for running the CLI and Prefect in subprocesses, and the table of the suite's lanes (lanes.py).

tests/ is on pytest's pythonpath, so test files import these as `support.<module>`."""
