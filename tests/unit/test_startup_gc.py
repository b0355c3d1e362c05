"""The collector paused while a process starts (sft_tokenize/startup_gc.py), in processes of their own: this
worker's collector stays as it is."""

from __future__ import annotations

import json
import subprocess
import sys

CHECK = """
import gc, json, os
from sft_tokenize.startup_gc import pause_collector, resume_collector

resume_collector()  # never paused: nothing changes
seen = {"untouched": [gc.isenabled(), gc.get_freeze_count()]}
pause_collector()
seen["paused"] = gc.isenabled()
read, write = os.pipe()
if os.fork() == 0:  # a child forked while paused starts paused, and resumes as its parent would
    child = [gc.isenabled()]
    resume_collector()
    child += [gc.isenabled(), gc.get_freeze_count() > 0]
    os.write(write, json.dumps(child).encode())
    os._exit(0)
os.wait()
seen["child"] = json.loads(os.read(read, 100))
resume_collector()
seen["resumed"] = [gc.isenabled(), gc.get_freeze_count() > 0]
resume_collector()  # once only
seen["again"] = gc.isenabled()
print(json.dumps(seen))
"""


def test_a_paused_process_and_its_forks_resume_once_with_what_they_imported_frozen_and_others_are_untouched():
    seen = json.loads(subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                                     check=True).stdout)
    assert seen == {"untouched": [True, 0], "paused": False, "child": [False, True, True], "resumed": [True, True],
                    "again": True}
