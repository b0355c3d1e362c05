"""Reading a published cache: open_cache, the trainer layouts and loaders, the packing index and its sampler.
Imports nothing from the build side, Prefect, Jinja or tokenizers."""
