"""Chat rendering and masking: a conversation rendered as its template renders it, and where its trained turns
lie in that text. Strings in, strings and character spans out: no tokenizer here."""
