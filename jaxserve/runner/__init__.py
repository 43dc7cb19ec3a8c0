"""Device side: bucketed step batches, the jitted step, sampling."""
