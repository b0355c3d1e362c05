"""The trainers' own data paths run over a cache: `verify_trainer` (`sft-tokenize verify CACHE --trainer NAME`).

It imports the base, the read side and the trainers' installed packages (only when called): never the build side.
"""
