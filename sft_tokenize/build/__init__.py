"""Building a cache: a run's options and plan, the slices' content keys, the shard writer, the shard store and
publishing. The only side that writes a cache; the read side never imports it."""
