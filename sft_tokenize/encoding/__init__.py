"""Encoding: tokenizers loaded and prepared once per content, exact fast encoders, and the processes that
encode a slice's batches on every core. Conversations in, `input_ids` and `loss_mask` out."""
