"""Lock backends, one module each; chosen by URL scheme through asynclock.connect()."""
