"""Fault injection for the tests: `install()` in this process, `FAULT_FILE_ENV` to set, and `SITE_DIR` to put on
PYTHONPATH so that every process started from here installs it too (sitecustomize.py)."""

from pathlib import Path

from support.faults.slice_faults import FAULT_FILE_ENV, install

SITE_DIR = Path(__file__).resolve().parent

__all__ = ["FAULT_FILE_ENV", "SITE_DIR", "install"]
