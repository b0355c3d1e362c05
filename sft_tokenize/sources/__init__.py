"""Where input comes from: resolving paths and URLs, listing directories, compressed files, per-format readers,
and the slices a run cuts the input into. Rows leave this package as conversations (or plain text)."""
