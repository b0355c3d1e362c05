"""The input formats: a reader each, behind the public base `FormatReader`."""
