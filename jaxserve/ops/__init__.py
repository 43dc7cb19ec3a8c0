"""Device-side kernels: paged KV writes and ragged paged attention."""
