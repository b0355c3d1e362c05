"""Prefect tasks, one module per task, each a thin wrapper over its plain function in `sft_tokenize`."""

# A failed slice's retries unless the run says otherwise: the tokenize_slice task's default and TokenizeRun's
# declared one. Here, with no Prefect import, so that the command line reads it before it imports Prefect.
RETRIES = 2

# A run of more slices than GROUP_ABOVE runs one task per group of slices, GROUP_SIZE slices on average at most
# (tokenize_slices.py); `--slices-per-task` sets the size.
GROUP_ABOVE = 256
GROUP_SIZE = 16
