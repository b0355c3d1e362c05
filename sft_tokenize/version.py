"""The package's version: `sft_tokenize.__version__`, and what its manifests and index records call the tool that
wrote them. In the base layer, so that both sides record it without importing the public API's package."""

__version__ = "0.1.0"
