"""Loaded by every Python process of a test session (conftest.py puts this directory on PYTHONPATH): installs
the slice faults of slice_faults.py, which act only where SFT_TOKENIZE_FAULT_FILE is set."""

import slice_faults

slice_faults.install()
